"""A config loaded for a run on this machine: validated, `--memory-gb` applied, and its paths checked where the
stages run (here, unless a remote Ray cluster holds them). What `omni run`, `omni plan` and `omni serve` refuse
before anything starts (AsyncOmni.load_config is the server's way in)."""
from __future__ import annotations

import math
from typing import Any

from omni.config.loader import load_config
from omni.config.preflight import check_paths as check_config_paths
from omni.config.preflight import remote_cluster
from omni.config.schema import MemoryConfig, PipelineConfig
from omni.errors import ConfigError


def load_checked(config: Any, overrides: Any = None, memory_gb: float | None = None,
                 check_paths: bool = True) -> tuple[PipelineConfig, str | None]:
    """Load and validate the config, and check its paths where the stages run (raises ConfigError).
    `memory_gb` (--memory-gb) sets runtime.memory.budget_gb; `check_paths` False: the config only.
    Returns (config, the Ray cluster whose nodes hold the paths, when they were not checked here)."""
    cfg = load_config(config, overrides)
    if memory_gb is not None:
        if not (math.isfinite(memory_gb) and memory_gb > 0):  # inf has no bytes: the plan would fail converting it
            raise ConfigError(f"--memory-gb: expected a finite number of GiB > 0 (got {memory_gb:g})",
                              field="--memory-gb")
        mem = cfg.runtime.memory or MemoryConfig()
        runtime = cfg.runtime.model_copy(update={"memory": mem.model_copy(update={"budget_gb": memory_gb})})
        cfg = cfg.model_copy(update={"runtime": runtime})
    if not check_paths:
        return cfg, None
    cluster = remote_cluster(cfg)
    if cluster is None:
        check_config_paths(cfg)
    return cfg, cluster
