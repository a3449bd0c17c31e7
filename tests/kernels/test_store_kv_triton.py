"""Triton store_kv (interpreter on CPU; real kernel on CUDA) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels.reference import store_kv_ref
from kernels.store_kv import store_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _caches(num_blocks=6, block_size=4, heads=2, head_dim=16, dtype=torch.float32):
    return (torch.zeros(num_blocks, block_size, heads, head_dim, dtype=dtype, device=DEVICE),
            torch.zeros(num_blocks, block_size, heads, head_dim, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_matches_reference_and_skips_negative(dtype, slot_dtype):
    g = torch.Generator().manual_seed(0)
    key = torch.randn(7, 2, 16, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(7, 2, 16, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([5, -1, 0, 23, 9, -7, 12], dtype=slot_dtype, device=DEVICE)
    kc, vc = _caches(dtype=dtype)
    kc_ref, vc_ref = _caches(dtype=dtype)
    dispatch.store_kv(key, value, kc, vc, slots, backend="triton")
    store_kv_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # a copy: bit exact
    assert int((kc != 0).any(-1).any(-1).sum()) == 5


def test_store_strided_key_value_and_odd_sizes():
    # key/value as views into a fused qkv projection; 3 heads x 24 dims (padded tiles).
    qkv = torch.randn(5, 9, 24, device=DEVICE)
    key, value = qkv[:, 3:6], qkv[:, 6:9]
    assert not key.is_contiguous()
    kc, vc = _caches(num_blocks=3, block_size=3, heads=3, head_dim=24)
    kc_ref, vc_ref = _caches(num_blocks=3, block_size=3, heads=3, head_dim=24)
    slots = torch.tensor([8, 0, 4, -1, 2], device=DEVICE)
    store_kv_triton(key, value, kc, vc, slots)
    store_kv_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_store_into_strided_cache_and_out_of_range_slot():
    both = torch.zeros(4, 2, 4, 2, 16, device=DEVICE)  # [num_blocks, K/V, block_size, Hkv, D]
    kc, vc = both[:, 0], both[:, 1]
    key, value = torch.randn(3, 2, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    store_kv_triton(key, value, kc, vc, torch.tensor([1, 999, 15], device=DEVICE))  # 999: past the cache
    assert torch.equal(kc[0, 1], key[0]) and torch.equal(vc[3, 3], value[2])
    assert int((both != 0).any(-1).any(-1).sum()) == 4  # two slots x K and V, nothing else


def test_store_casts_to_cache_dtype():
    key, value = torch.randn(2, 2, 16, device=DEVICE), torch.randn(2, 2, 16, device=DEVICE)
    kc, vc = _caches(dtype=torch.bfloat16)
    store_kv_triton(key, value, kc, vc, torch.tensor([0, 1], device=DEVICE))
    # One cast to bf16: torch's own cast gives the exact expected bits (the interpreter may truncate
    # instead of rounding to nearest, so allow that one ulp: 2u = 2**-7 of the value, no more).
    assert kc.dtype == torch.bfloat16
    torch.testing.assert_close(kc[0, :2].float(), key, rtol=2 * torch.finfo(torch.bfloat16).eps / 2, atol=0)


def test_store_empty_is_noop():
    kc, vc = _caches()
    store_kv_triton(torch.zeros(0, 2, 16, device=DEVICE), torch.zeros(0, 2, 16, device=DEVICE), kc, vc,
                    torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert not kc.any()


@pytest.mark.parametrize(
    "key_shape,slots,match",
    [
        ((3, 2, 8), [0, 1, 2], "does not match"),
        ((3, 2, 16), [0, 1], "slot_mapping must be 1-D with num_tokens=3"),
        ((3, 32), [0, 1, 2], "key must be"),
    ],
)
def test_store_launcher_errors(key_shape, slots, match):
    kc, vc = _caches()
    key = torch.randn(*key_shape, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        store_kv_triton(key, key, kc, vc, torch.tensor(slots, device=DEVICE))


def test_store_launcher_rejects_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cache = torch.zeros(2, 4, 2, 16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        store_kv_triton(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), cache, cache.clone(), torch.tensor([0]))
