"""Loading a stage model: dtype and device resolution, one call of the model class's `load`.

Both engines load through `load_stage_model`; the model class and the resolved model
path come from the engine config (the pipeline's engine factory looks both up in the
registry). The stage model loads its own tokenizer, next to the weights unless a
tokenizer path is given.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni.engine.runner.host_allocator import tune_host_allocator
from omni.engine.stage_model import StageModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICES = ("auto", "cpu", "cuda")


def resolve_dtype(stage: str, dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"stage {stage}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(stage: str, device: str) -> torch.device:
    """"auto": CUDA when available, else CPU."""
    if device not in DEVICES:
        raise ValueError(f"stage {stage}: device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"stage {stage}: device: cuda, but torch sees no CUDA device here (torch {torch.__version__}): "
                         "use device: auto (CUDA where there is one) or cpu")
    return torch.device(device)


def load_stage_model(stage: str, model_cls: type[StageModel], model_path: str | Path, *, dtype: str,
                     device: str, model_kwargs: dict[str, Any] | None = None,
                     tokenizer_path: str | Path | None = None) -> StageModel:
    """Load `model_cls` from `model_path` (already resolved to a local path)."""
    # Every process that runs a stage loads it here first: the step loop's allocations follow (host_allocator.py).
    tune_host_allocator()
    return model_cls.load(Path(model_path), dtype=resolve_dtype(stage, dtype), device=resolve_device(stage, device),
                          model_kwargs=dict(model_kwargs or {}),
                          tokenizer_path=Path(tokenizer_path) if tokenizer_path else None)
