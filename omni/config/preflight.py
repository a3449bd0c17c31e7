"""Checks of a valid config against the machine the stages will run on, before anything starts.

`load_config` checks what a config says; this checks that the model and tokenizer paths it
names exist (or name something their scheme knows, e.g. a builtin checkpoint) and that a model
directory holds what its loader reads first (config.json; a tokenizer where the stage tokenizes),
without loading or building anything, so that `omni validate` says what `omni run` would fail on.
Paths are only meaningful where the stages run: on a Ray cluster (runtime.ray_address or
RAY_ADDRESS) they are left to the stage actors.
"""
from __future__ import annotations

import os
from pathlib import Path

from omni import registry
from omni.config.schema import PipelineConfig, StageConfig
from omni.errors import ConfigError

# What a Hugging Face tokenizer is saved as (any one of them: fast, sentencepiece or BPE vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def remote_cluster(cfg: PipelineConfig) -> str | None:
    """The address of the Ray cluster the stages would run on, or None when they run on this machine."""
    if cfg.runtime.backend == "local":
        return None
    return cfg.runtime.ray_address or os.environ.get("RAY_ADDRESS") or None


def _needs_tokenizer(stage: StageConfig) -> bool:
    """A stage that reads the prompt's text (an entry stage) or hands text back tokenizes."""
    return not stage.inputs or stage.final_output == "text"


def _variable_hint(stage: StageConfig, field: str) -> str:
    """Which environment variable sets the path, and whether it is set (its default applies when not)."""
    names = stage.path_variables(field)
    if not names:
        return ""
    unset = [n for n in names if n not in os.environ]
    if unset:
        return (f"; the config reads it from ${unset[0]}, which is not set (so its default applies): "
                f"export {unset[0]}=<the model's directory>")
    return f"; the config reads it from ${names[0]}"


def _stage_problem(stage: StageConfig, field: str, value: str) -> str | None:
    what = "model path" if field == "model_path" else "tokenizer path"
    try:
        registry.check_model_path(value, what)
    except ValueError as e:
        return f"{e}{_variable_hint(stage, field)}"
    path = Path(os.path.expanduser(os.path.expandvars(value)))  # as registry.check_model_path reads it
    if not path.is_dir():
        return None  # a scheme's name (builtin:NAME), or one file (GGUF): its loader reads what it holds
    if field == "model_path" and not (path / "config.json").is_file():
        return (f"{what} {value!r} holds no config.json: give the directory of a Hugging Face checkpoint "
                f"(config.json, the weights, the tokenizer){_variable_hint(stage, field)}")
    if _needs_tokenizer(stage) and (field == "tokenizer" or stage.tokenizer is None):
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            return (f"{what} {value!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}), and this "
                    f"stage tokenizes (it takes the prompt or returns text): give a checkpoint with its tokenizer, or set `tokenizer`"
                    f"{_variable_hint(stage, field)}")
    return None


def check_paths(cfg: PipelineConfig) -> None:
    """Raise ConfigError naming the stage and field of every model/tokenizer path that cannot resolve or
    lacks what its loader reads; a problem several stages share is named once, with all their names."""
    problems: dict[tuple[str, str], list[str]] = {}  # (field, problem) -> the stages that have it
    for s in cfg.stages:
        if not registry.stage_model_entry(s.model).checkpoint:
            continue  # a model that loads nothing from model_path (a test double)
        for field in ("model_path", "tokenizer"):
            value = getattr(s, field)
            if value is None:
                continue
            problem = _stage_problem(s, field, value)
            if problem is not None:
                problems.setdefault((field, problem), []).append(s.name)
    if problems:
        raise ConfigError("; ".join(
            f"{'stage' if len(names) == 1 else 'stages'} {', '.join(map(repr, names))}: {field}: {problem}"
            for (field, problem), names in problems.items()))
