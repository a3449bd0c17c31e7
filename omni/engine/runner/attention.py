"""omni's attention function for transformers models.

Registered under one name in transformers' `AttentionInterface`. Because the
name is deliberately *not* registered in `AttentionMaskInterface`,
transformers skips building dense causal masks: our batches are packed varlen
`(1, total_tokens)` and causality comes from the paged metadata instead.
"""
from __future__ import annotations

import torch

from kernels import dispatch

from omni.engine.runner.forward_context import get_forward_context

ATTN_IMPLEMENTATION = "omni_paged"
_registered = False


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    ctx = get_forward_context()
    meta = ctx.attn_metadata
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("omni paged attention does not support sliding-window layers yet")
    key_cache, value_cache = ctx.kv_caches[module.layer_idx]
    # [1, H, T, D] -> [T, H, D]: views, no copies.
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    dispatch.store_kv(k, v, key_cache, value_cache, meta.slot_mapping, backend=ctx.attention_backend)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    out = dispatch.paged_attention(
        q,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scaling,
        backend=ctx.attention_backend,
    )
    return out.unsqueeze(0), None  # [1, T, Hq, D], as transformers expects


def register_attention() -> str:
    """Register omni's attention with transformers (idempotent); returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        _registered = True
    return ATTN_IMPLEMENTATION
