"""The interface between the engine and a model-specific stage model.

The runtime knows nothing model-specific: a stage model (in `stages/`) loads
its weights and exposes embedding, a packed forward pass and logits. Whatever
per-token tensors `forward` returns besides `hidden_states` are discovered by
the runner and cached/concatenated like hidden states (see tensor_cache.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(slots=True)
class KVSpec:
    """What the runner needs to allocate the paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class StageModel:
    """Base class of stage models. Subclasses implement every method below."""

    # False for generation stages such as token2wav: no KV cache, no prefix caching.
    autoregressive: bool = True

    hidden_size: int
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None,
             tokenizer_path: Path | None = None) -> "StageModel":
        raise NotImplementedError

    def kv_spec(self) -> KVSpec:
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] input embeddings."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """One packed varlen forward pass over T tokens (exactly one of
        input_ids [T] / inputs_embeds [T, hidden]). Returns at least
        "hidden_states": [T, hidden] (the last hidden states)."""
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        raise NotImplementedError
