"""Loading a pipeline config: YAML or a mapping, stage overrides, one-line errors, the graph's checks.

`load_config(path_or_dict, stage_overrides=None)` is the one entry point; it raises `ConfigError`
(a ValueError) whose message names the stage and field. The schema itself is data (omni/config/schema.py);
the stage graph's checks (edges, cycles, final outputs) run here, through omni.pipeline.graph.
"""
from __future__ import annotations

import difflib
import json
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from omni.config.schema import PipelineConfig
from omni.errors import ConfigError
from omni.pipeline.graph import StageGraph
from omni.config.pydantic_errors import problems, render, union_message
from omni.config.strict import load_yaml


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def parse_stage_overrides(overrides: str | Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """JSON text or a mapping {stage_name: {field: value, ...}}."""
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ConfigError(f"stage_overrides: not valid JSON: {e}") from None
    if not isinstance(overrides, Mapping):
        raise ConfigError("stage_overrides: must map stage names to field overrides, "
                          'e.g. {"talker": {"enable_prefix_caching": false}}')
    for k, v in overrides.items():
        if not isinstance(v, Mapping):
            raise ConfigError(f"stage_overrides: {k!r}: must be a mapping of fields, got {type(v).__name__}")
    return {str(k): dict(v) for k, v in overrides.items()}


def merge_stage_overrides(base: Mapping[str, Mapping[str, Any]],
                          update: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Two override sets in one: `update`'s fields over `base`'s, nested mappings merged (a benchmark's
    own overrides, then the user's --stage-overrides)."""
    out = {k: dict(v) for k, v in base.items()}
    for stage, fields in update.items():
        out[stage] = _deep_merge(out.get(stage, {}), fields)
    return out


def _unwrap(ann: Any) -> Any:
    """list[X] -> X, X | None -> X, str | Model -> Model (the one model of a union: what an object there is)."""
    while typing.get_origin(ann) in (list, typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) != 1:
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(models) != 1:
                break
            args = models
        ann = args[0]
    return ann


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class validating the object at `loc` (as the user wrote it; for 'allowed keys' hints)."""
    cls: Any = PipelineConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        cls = _unwrap(cls.model_fields[part].annotation)
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _format_errors(err: ValidationError, raw: Mapping[str, Any]) -> str:
    """One line per problem: "stage 'talker': cache.block_size: <what is wrong> (got 0)".

    Paths are written as in the YAML (`inputs[0].stream`); a value that no member of a union field takes is
    one problem saying what the field takes (`cache.memory_budget_mb: expected a number or "auto" (got
    "lots")`), never one complaint per member under pydantic's names (`memory_budget_mb.float`,
    `inputs.0.InputEdge`). A value shaped like one member (an object for `str | InputEdge`) gets its errors."""
    stages = raw.get("stages") if isinstance(raw, Mapping) else None
    lines = []
    for problem in problems(err.errors()):
        e, loc = problem.error, problem.user_loc()
        msg = e["msg"]
        for prefix in ("Value error, ", "Assertion failed, "):
            if msg.startswith(prefix):
                msg = msg[len(prefix):]
        if problem.union is None and msg.startswith(("stage '", "stages")):  # our own messages already say where
            lines.append(msg)
            continue
        where, rest = "", loc
        if len(loc) >= 2 and loc[0] == "stages" and isinstance(loc[1], int):
            name = None
            if isinstance(stages, list) and loc[1] < len(stages) and isinstance(stages[loc[1]], Mapping):
                name = stages[loc[1]].get("name")
            where = f"stage {name!r}" if isinstance(name, str) else f"stages[{loc[1]}]"
            rest = loc[2:]
        if problem.union is not None:
            text = union_message(problem.union)
        elif e["type"] == "extra_forbidden":
            model = _model_at(loc[:-1])
            allowed = f" (allowed: {', '.join(model.model_fields)})" if model else ""
            close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1) if model else []
            guess = f"; did you mean {close[0]!r}?" if close else ""
            text, rest = f"unknown key {str(loc[-1])!r}{allowed}{guess}", rest[:-1]
        elif e["type"] == "missing":
            text = "required field is missing"
        elif e["type"] == "value_error" or isinstance(e.get("input"), (dict, list)):
            text = msg
        else:
            text = f"{msg} (got {e.get('input')!r})"
        lines.append(": ".join([p for p in (where, render(rest)) if p] + [text]))
    return "; ".join(dict.fromkeys(lines))


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = load_yaml(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config: {e}") from None
    except yaml.YAMLError as e:  # one line: "FILE:LINE: invalid YAML: what"
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping with `stages`, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    return data


def load_config(
    path_or_dict: str | os.PathLike[str] | Mapping[str, Any] | PipelineConfig,
    stage_overrides: str | Mapping[str, Any] | None = None,
) -> PipelineConfig:
    """Load, override and validate a pipeline config. Raises ConfigError."""
    if isinstance(path_or_dict, PipelineConfig):
        if not stage_overrides:
            return path_or_dict
        raw: dict[str, Any] = path_or_dict.model_dump(mode="python")
    elif isinstance(path_or_dict, Mapping):
        raw = dict(path_or_dict)
    elif isinstance(path_or_dict, (str, os.PathLike)):
        raw = _read(Path(path_or_dict))
    else:
        raise ConfigError(f"config: expected a path, a mapping or a PipelineConfig, got {type(path_or_dict).__name__}")

    overrides = parse_stage_overrides(stage_overrides)
    if overrides:
        stages = raw.get("stages")
        if not isinstance(stages, list):
            raise ConfigError("stages: must be a list of stages")
        names = [s.get("name") for s in stages if isinstance(s, Mapping)]
        unknown = [k for k in overrides if k not in names]
        if unknown:
            raise ConfigError(f"stage_overrides: unknown stage {unknown[0]!r} (stages: {', '.join(map(str, names))})")
        raw = dict(raw)
        raw["stages"] = [
            _deep_merge(dict(s), overrides[s["name"]]) if isinstance(s, Mapping) and s.get("name") in overrides
            else s
            for s in stages
        ]
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, raw)) from None
    StageGraph.of(config)  # the DAG checks (ConfigError naming the problem); the graph stays with the config
    return config
