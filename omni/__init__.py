"""omni: a Ray-distributed runtime for multi-stage omni model pipelines.

    from omni import Omni, SamplingParams
    with Omni("stage_configs/tiny_chain.yaml") as o:
        outs = o.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))

Public names are imported lazily, so that `import omni.engine.core.kv_cache` (pure
Python) does not pull in torch, pydantic or Ray.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Omni": "omni.api",
    "AsyncOmni": "omni.async_api",
    "StageDelta": "omni.messages",
    "SamplingParams": "omni.sampling_params",
    "StageInput": "omni.messages",
    "StageOutput": "omni.messages",
    "RequestOutput": "omni.messages",
    "MultiModalInput": "omni.messages",
    "load_config": "omni.config.loader",
    "PipelineConfig": "omni.config.schema",
    "StageConfig": "omni.config.schema",
    "OmniError": "omni.errors",
    "ConfigError": "omni.errors",
    "StageError": "omni.errors",
    "StageStartError": "omni.errors",
    "BackendClosedError": "omni.errors",
    "RequestError": "omni.errors",
    "ContextLengthError": "omni.errors",
    "RequestTimeoutError": "omni.errors",
    "RequestAbortedError": "omni.errors",
}

__all__ = [
    "AsyncOmni", "StageDelta", "BackendClosedError", "ConfigError", "MultiModalInput", "Omni", "OmniError", "PipelineConfig",
    "RequestOutput", "SamplingParams", "StageConfig", "StageError", "StageInput", "StageOutput",
    "StageStartError", "load_config", "RequestError", "ContextLengthError", "RequestTimeoutError",
    "RequestAbortedError",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from omni.api import Omni
    from omni.async_api import AsyncOmni
    from omni.config.schema import PipelineConfig, StageConfig
    from omni.config.loader import load_config
    from omni.errors import (BackendClosedError, ConfigError, ContextLengthError, OmniError, RequestAbortedError,
                             RequestError, RequestTimeoutError, StageError, StageStartError)
    from omni.messages import MultiModalInput, RequestOutput, StageDelta, StageInput, StageOutput
    from omni.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'omni' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
