"""What the `omni` commands share (omni/cli/ and serve/launch.py both import it, neither imports the other):
the exit-status convention of an error, and loading a config checked against this machine.
"""
from __future__ import annotations

import math
import sys
from typing import Any


def error(msg: str, code: int = 2) -> int:
    """Print one `error: ...` line on stderr; the exit status (2: bad config, prompts or usage; 1: failed)."""
    print(f"error: {msg}", file=sys.stderr)
    return code


def load_checked(config: str, overrides: str | None, memory_gb: float | None = None) -> tuple[Any, str | None]:
    """Load and validate the config, and check its paths where the stages run (raises ConfigError).
    `memory_gb` (--memory-gb) sets runtime.memory.budget_gb.
    Returns (config, the Ray cluster whose nodes hold the paths, when they were not checked here)."""
    from omni.config.loader import load_config
    from omni.config.preflight import check_paths, remote_cluster

    cfg = load_config(config, overrides)
    if memory_gb is not None:
        from omni.config.schema import MemoryConfig
        from omni.errors import ConfigError

        if not (math.isfinite(memory_gb) and memory_gb > 0):  # inf has no bytes: the plan would fail converting it
            raise ConfigError(f"--memory-gb: expected a finite number of GiB > 0 (got {memory_gb:g})",
                              field="--memory-gb")
        mem = cfg.runtime.memory or MemoryConfig()
        runtime = cfg.runtime.model_copy(update={"memory": mem.model_copy(update={"budget_gb": memory_gb})})
        cfg = cfg.model_copy(update={"runtime": runtime})
    cluster = remote_cluster(cfg)
    if cluster is None:
        check_paths(cfg)
    return cfg, cluster
