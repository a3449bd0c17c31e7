"""Name -> stage model class, name -> input processor.

Entries are "module:attr" strings, imported only when resolved, so that
validating a config or starting the driver does not import torch or every
model in the tree. A config may also name a target directly ("pkg.mod:Cls");
such strings resolve without any registration.

Input processors turn what the upstream stages produced for a request into
the downstream stage's input:

    fn(upstream: dict[str, StageOutput], request: StageInput) -> StageInput

`upstream` holds one entry per name in the downstream stage's `inputs`, in
that order; `request` is the user's original input for that request.

A Ray actor does not see registrations made in the driver after import;
`snapshot()` / `restore()` carry them over (the Ray backend does this).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True, slots=True)
class StageModelEntry:
    target: Any  # "module:attr" string, or the class itself
    # False for generation stages such as token2wav: they have no KV cache, so
    # prefix caching does not apply to them.
    autoregressive: bool = True


_STAGE_MODELS: dict[str, StageModelEntry] = {
    "causal_lm": StageModelEntry("stages.causal_lm:CausalLMStage"),
    "qwen2_5_omni_thinker": StageModelEntry("stages.qwen2_5_omni:Qwen2_5OmniThinkerStage"),
    "qwen2_5_omni_talker": StageModelEntry("stages.qwen2_5_omni:Qwen2_5OmniTalkerStage"),
    "qwen2_5_omni_token2wav": StageModelEntry("stages.qwen2_5_omni:Qwen2_5OmniToken2WavStage", autoregressive=False),
}
_INPUT_PROCESSORS: dict[str, Any] = {
    "passthrough_tokens": "omni.pipeline.orchestrator:passthrough_tokens",
    "hidden_to_embeds": "stages.processors:hidden_to_embeds",
    "thinker2talker": "stages.qwen2_5_omni:thinker2talker",
    "talker2wav": "stages.qwen2_5_omni:talker2wav",
}


def is_target(name: str) -> bool:
    """True for a "module:attr" string (as opposed to a registered name)."""
    return isinstance(name, str) and ":" in name


def import_target(target: str) -> Any:
    """Import "package.module:attr" (attr may be dotted). Raises ImportError/AttributeError/ValueError."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{target!r} is not of the form 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def register_stage_model(name: str, target: Any, *, autoregressive: bool = True) -> None:
    """Register a stage model class (or its "module:Class" string) under `name`."""
    if not name or is_target(name):
        raise ValueError(f"stage model name must be non-empty and contain no ':', got {name!r}")
    _STAGE_MODELS[name] = StageModelEntry(target, autoregressive)


def register_input_processor(name: str, target: Any) -> None:
    """Register an input processor function (or its "module:function" string) under `name`."""
    if not name or is_target(name):
        raise ValueError(f"input processor name must be non-empty and contain no ':', got {name!r}")
    _INPUT_PROCESSORS[name] = target


def stage_model_names() -> list[str]:
    return sorted(_STAGE_MODELS)


def input_processor_names() -> list[str]:
    return sorted(_INPUT_PROCESSORS)


def stage_model_target(name: str) -> Any:
    """The registered target of `name` (a string or an object), or `name` itself for "module:attr"."""
    if is_target(name):
        return name
    if name not in _STAGE_MODELS:
        raise KeyError(f"unknown stage model {name!r}; registered: {stage_model_names()} "
                       "(or give 'package.module:Class')")
    return _STAGE_MODELS[name].target


def input_processor_target(name: str) -> Any:
    if is_target(name):
        return name
    if name not in _INPUT_PROCESSORS:
        raise KeyError(f"unknown input processor {name!r}; registered: {input_processor_names()} "
                       "(or give 'package.module:function')")
    return _INPUT_PROCESSORS[name]


def is_autoregressive(name: str) -> bool:
    """False when registered as non-autoregressive or when the class says `autoregressive = False`.

    Imports the model class (like `resolve_stage_model`).
    """
    if not is_target(name) and name in _STAGE_MODELS and not _STAGE_MODELS[name].autoregressive:
        return False
    return bool(getattr(resolve_stage_model(name), "autoregressive", True))


def _resolve(target: Any) -> Any:
    return import_target(target) if isinstance(target, str) else target


def resolve_stage_model(name: str) -> type:
    """The stage model class for a registered name or a "module:Class" string."""
    obj = _resolve(stage_model_target(name))
    if not isinstance(obj, type):
        raise TypeError(f"stage model {name!r} resolved to {obj!r}, which is not a class")
    return obj


def resolve_input_processor(name: str) -> Callable[..., Any]:
    """The input processor for a registered name or a "module:function" string."""
    obj = _resolve(input_processor_target(name))
    if not callable(obj):
        raise TypeError(f"input processor {name!r} resolved to {obj!r}, which is not callable")
    return obj


def snapshot() -> dict[str, dict[str, Any]]:
    """Both tables, to re-create this process's registrations in another one."""
    return {"stage_models": dict(_STAGE_MODELS), "input_processors": dict(_INPUT_PROCESSORS)}


def restore(snap: dict[str, dict[str, Any]]) -> None:
    _STAGE_MODELS.update(snap.get("stage_models", {}))
    _INPUT_PROCESSORS.update(snap.get("input_processors", {}))
