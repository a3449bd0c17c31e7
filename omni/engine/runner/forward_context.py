"""Per-step attention metadata, visible to the attention function.

transformers calls our attention function once per layer with only
(module, q, k, v, mask, **kwargs); everything paged attention needs about the
batch (slot mapping, block tables, query offsets, sequence lengths) and the
layer's KV cache lives here, set for exactly one forward pass by one scoped
`with set_forward_context(...)`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new K/V row goes
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: packed query offsets
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length incl. this step's tokens


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    # Per decoder layer (key_cache, value_cache), each
    # [num_blocks, block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    attention_backend: str | None = None  # None = auto (see kernels)
    # CPU-side view of the batch, for stage models that keep per-request state
    # (e.g. multimodal rotary positions): request ids in packed order and the
    # number of tokens each had computed before this step.
    req_ids: list[str] | None = None
    num_computed_tokens: list[int] | None = None
    query_start_loc_cpu: list[int] | None = None

    def request_spans(self) -> Iterator[tuple[str, int, int, int]]:
        """(request id, its first row in the packed batch, first position, end
        position) for every request of the step, in packed order."""
        qs = self.query_start_loc_cpu
        for i, rid in enumerate(self.req_ids or ()):
            start = self.num_computed_tokens[i]
            yield rid, qs[i], start, start + qs[i + 1] - qs[i]


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("omni_forward_context", default=None)


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "omni paged attention called outside a forward pass: the model must be run "
            "by omni's ModelRunner (no ForwardContext is set)"
        )
    return ctx
