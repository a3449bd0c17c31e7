"""omni: a Ray-distributed runtime for multi-stage omni model pipelines.

    from omni import Omni, SamplingParams
    with Omni("stage_configs/tiny_chain.yaml") as o:
        outs = o.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))

Public names are imported lazily, so that `import omni.engine.kv_cache` (pure
Python) does not pull in torch, pydantic or Ray.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Omni": "omni.api",
    "AsyncOmni": "omni.async_api",
    "StageDelta": "omni.outputs",
    "SamplingParams": "omni.sampling_params",
    "StageInput": "omni.outputs",
    "StageOutput": "omni.outputs",
    "RequestOutput": "omni.outputs",
    "MultiModalInput": "omni.outputs",
    "load_config": "omni.config_loader",
    "PipelineConfig": "omni.config",
    "StageConfig": "omni.config",
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
    from omni.config import PipelineConfig, StageConfig
    from omni.config_loader import load_config
    from omni.errors import (BackendClosedError, ConfigError, ContextLengthError, OmniError, RequestAbortedError,
                             RequestError, RequestTimeoutError, StageError, StageStartError)
    from omni.outputs import MultiModalInput, RequestOutput, StageDelta, StageInput, StageOutput
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
