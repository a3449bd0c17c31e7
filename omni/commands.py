"""What the `omni` commands share (cli.py and serve/launch.py both import it, neither imports the other):
the exit-status convention of an error, and loading a config checked against this machine.
"""
from __future__ import annotations

import sys
from typing import Any


def error(msg: str, code: int = 2) -> int:
    """Print one `error: ...` line on stderr; the exit status (2: bad config, prompts or usage; 1: failed)."""
    print(f"error: {msg}", file=sys.stderr)
    return code


def load_checked(config: str, overrides: str | None) -> tuple[Any, str | None]:
    """Load and validate the config, and check its paths where the stages run (raises ConfigError).
    Returns (config, the Ray cluster whose nodes hold the paths, when they were not checked here)."""
    from omni.config_loader import load_config
    from omni.preflight import check_paths, remote_cluster

    cfg = load_config(config, overrides)
    cluster = remote_cluster(cfg)
    if cluster is None:
        check_paths(cfg)
    return cfg, cluster
