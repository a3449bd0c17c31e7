"""Triton kernel: write new K/V rows into the paged cache by slot mapping.

key/value [T, Hkv, D] (any strides, e.g. views into a fused qkv projection)
-> key_cache/value_cache [num_blocks, block_size, Hkv, D] at
slot = block_id * block_size + offset. Negative slots are padding and skipped;
slots past the cache are skipped too (never a stray write; the torch
reference raises on them instead).

Imported lazily by ``kernels`` on first Triton use: importing this module
imports triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.reference import check_store_kv_args


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    num_slots, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: Hkv * D elements of K and of V.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(key_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d * stride_kcd,
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d * stride_vcd,
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Triton needs device tensors, unless the interpreter runs it on CPU."""
    if interpreting():
        return
    for t in tensors:
        if t.device.type == "cpu":
            raise ValueError(
                "the Triton backend needs CUDA tensors (got CPU tensors); use backend='torch' "
                "or set TRITON_INTERPRET=1 before importing triton"
            )


def store_kv_triton(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Launcher: checks shapes/dtypes/devices, then one program per token."""
    check_store_kv_args(key, value, key_cache, value_cache, slot_mapping)
    check_triton_device(key, key_cache)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_blocks, block_size = key_cache.shape[:2]
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        num_blocks * block_size, block_size,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )
