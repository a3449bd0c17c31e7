"""The interface between the engines and model-specific stage models (in `stages/`).

The runtime knows nothing model-specific. A stage model is one of two kinds, each
run by its own engine (the pipeline's engine factory picks it from the registry):

    AutoregressiveStageModel   StageEngine: KV cache, scheduler, prefix caching;
                               embed / packed forward / logits, per-request hooks
    OneShotStageModel          GenerationStageEngine: one call per request
                               (e.g. token2wav: codec tokens -> waveform)

Whatever per-token tensors `forward` returns besides `hidden_states` are
discovered by the runner and cached/concatenated like hidden states (see
tensor_cache.py). Every hook an engine calls is declared here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from omni.engine.memory import StageGeometry
    from omni.engine.request import MultiModalFeature
    from omni.outputs import StageInput


@dataclass(slots=True)
class KVSpec:
    """What the runner needs to allocate the paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(slots=True)
class PreparedPrompt:
    """A model-specific stage's view of one request's prompt (see AutoregressiveStageModel.preprocess)."""

    token_ids: list[int]
    # Multimodal inputs placed in the prompt (content hash + placeholder span):
    # they become extra keys of the block hashes.
    mm_features: list["MultiModalFeature"] = field(default_factory=list)
    # [num_tokens, hidden] rows replacing the token embeddings (None: embed token ids).
    prompt_embeds: np.ndarray | None = None
    # Anything the stage model keeps per request (pixel values, mrope positions, ...).
    extra: dict[str, Any] = field(default_factory=dict)


class StageModel:
    """What every stage model has: loading, its device/dtype/tokenizer, and stats."""

    # Facts the registry also records for registered models (omni/registry.py).
    autoregressive: bool
    emits_hidden_states: bool

    tokenizer: Any = None
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None,
             tokenizer_path: Path | None = None) -> "StageModel":
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Model-specific counters merged into the stage's stats (e.g. encoder cache hits)."""
        return {}


class AutoregressiveStageModel(StageModel):
    """A model run token by token by StageEngine. Subclasses implement every method up to the hooks."""

    autoregressive = True
    emits_hidden_states = True
    # True when `forward` reads nothing but its tensor arguments and the
    # ForwardContext's device tensors (no per-request host state), so that a
    # decode step can be captured once in a CUDA graph and replayed.
    supports_cuda_graphs: bool = False

    hidden_size: int  # width of the last hidden states it emits
    # Width of rows accepted as `prompt_embeds` when it differs from
    # hidden_size (a talker fed a wider thinker's embeddings); None = hidden_size.
    prompt_embed_size: int | None = None
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None

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

    # -- optional hooks (multimodal / model-specific stages) -----------------
    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> "StageGeometry | None":
        """Cache geometry (layers, KV heads, head dim, hidden size) read from the checkpoint's config
        without loading weights, so that the engine refuses caches the machine cannot hold before it
        loads the model (omni/engine/memory.py). None: known only once loaded."""
        return None

    def preprocess(self, inp: "StageInput") -> PreparedPrompt | None:
        """Turn a request into token ids etc.; None = the engine's default
        (tokenize text with the stage's tokenizer, or take the given ids/embeds)."""
        return None

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: "StageInput") -> None:
        """Called once per admitted request, before its first forward pass."""

    def remove_request(self, request_id: str) -> None:
        """Called once when a request leaves the stage (finished, aborted or failed)."""


class OneShotStageModel(StageModel):
    """A model that turns one request into its output in one call (GenerationStageEngine)."""

    autoregressive = False
    emits_hidden_states = False
    max_model_len: int

    def prepare_generation(self, inp: "StageInput", seed: int) -> Any:
        """Validate a request when it arrives (raise ValueError naming the field); returns the job."""
        raise NotImplementedError

    def run_generation(self, job: Any) -> dict[str, Any]:
        """Run one job: {"audio": np.ndarray, ...}; other entries pass through to the output."""
        raise NotImplementedError


__all__ = ["AutoregressiveStageModel", "KVSpec", "OneShotStageModel", "PreparedPrompt", "StageModel"]
