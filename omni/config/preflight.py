"""Checks of a valid config against the machine the stages will run on, before anything starts.

`load_config` checks what a config says; this checks that the model and tokenizer paths it
names exist (or name something their scheme knows, e.g. a builtin checkpoint) without loading
or building anything, so that `omni validate` says what `omni run` would fail on. Paths are
only meaningful where the stages run: on a Ray cluster (runtime.ray_address or RAY_ADDRESS)
they are left to the stage actors.
"""
from __future__ import annotations

import os

from omni import registry
from omni.config.schema import PipelineConfig
from omni.errors import ConfigError


def remote_cluster(cfg: PipelineConfig) -> str | None:
    """The address of the Ray cluster the stages would run on, or None when they run on this machine."""
    if cfg.runtime.backend == "local":
        return None
    return cfg.runtime.ray_address or os.environ.get("RAY_ADDRESS") or None


def check_paths(cfg: PipelineConfig) -> None:
    """Raise ConfigError naming the stage and field of every model/tokenizer path that cannot resolve."""
    errors = []
    for s in cfg.stages:
        if not registry.stage_model_entry(s.model).checkpoint:
            continue  # a model that loads nothing from model_path (a test double)
        for field, what in (("model_path", "model path"), ("tokenizer", "tokenizer path")):
            value = getattr(s, field)
            if value is None:
                continue
            try:
                registry.check_model_path(value, what)
            except ValueError as e:
                errors.append(f"stage {s.name!r}: {field}: {e}")
    if errors:
        raise ConfigError("; ".join(errors))
