"""kernels.reference (the CPU production path) against a naive dense float64 oracle,
plus the backend dispatch in kernels/__init__.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kernels
from kernels import dispatch
from kernels.reference import paged_attention_ref, store_kv_ref
from tests.tolerances import attention_atol

# --------------------------------------------------------------------------- helpers (also used by the Triton tests)


def make_batch(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size=16, dtype=torch.float32,
               seed=0, spare_blocks=7):
    """A packed batch over a paged cache with shuffled, non-contiguous block tables.

    Table entries past each sequence's last block are -1 (never read).
    """
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(q_lens)
    need = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(need + [1]) + 2
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((num_seqs, max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        block_tables[s, :n] = perm[used:used + n].int()
        used += n
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    query = torch.randn(int(qsl[-1]), num_q_heads, head_dim, generator=g).to(dtype)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


def naive_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale):
    """Dense float64 causal attention, one sequence at a time, no tricks."""
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    for s in range(seq_lens.shape[0]):
        a, b, n = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(seq_lens[s])
        if b == a:
            continue
        positions = torch.arange(n)
        blocks = block_tables[s].long()[positions // block_size]
        k = key_cache[blocks, positions % block_size].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = value_cache[blocks, positions % block_size].double().repeat_interleave(group, dim=1)
        q = query[a:b].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(b - a) + n - (b - a)
        scores = scores.masked_fill(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def random_lengths(rng: torch.Generator, num_seqs: int, max_len: int):
    """Mixed batch: decode, prefill with and without a cached prefix, chunked prefill."""
    q_lens, seq_lens = [], []
    for _ in range(num_seqs):
        kind = int(torch.randint(0, 4, (1,), generator=rng))
        n = int(torch.randint(1, max_len + 1, (1,), generator=rng))
        if kind == 0:  # decode
            q = 1
        elif kind == 1:  # full prefill
            q = n
        elif kind == 2:  # short multi-token (batched path)
            q = min(n, int(torch.randint(2, 9, (1,), generator=rng)))
        else:  # prefill on top of a prefix / chunk
            q = int(torch.randint(1, n + 1, (1,), generator=rng))
        q_lens.append(q)
        seq_lens.append(n)
    return q_lens, seq_lens


# --------------------------------------------------------------------------- paged_attention_ref


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (6, 2)])
def test_reference_matches_naive_random_mixed(seed, heads):
    rng = torch.Generator().manual_seed(100 + seed)
    q_lens, seq_lens = random_lengths(rng, num_seqs=int(torch.randint(1, 12, (1,), generator=rng)), max_len=90)
    block_size = [16, 4, 5][seed % 3]
    batch = make_batch(q_lens, seq_lens, *heads, head_dim=32, block_size=block_size, dtype=torch.float64, seed=seed)
    out = paged_attention_ref(**batch, scale=0.2)
    # float64 both: the bound for two float64 evaluations of the same attention (about 1e-13 here).
    torch.testing.assert_close(out, naive_attention(**batch, scale=0.2), rtol=0,
                               atol=attention_atol(batch, 0.2, compute=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_dtypes(dtype):
    q_lens = [1, 1, 7, 1, 23, 40, 3, 1]
    seq_lens = [13, 70, 7, 1, 50, 40, 3, 129]
    batch = make_batch(q_lens, seq_lens, 8, 2, 64, dtype=dtype, seed=3)
    out = paged_attention_ref(**batch, scale=0.125)
    assert out.dtype == dtype
    # SDPA accumulates in fp32 (float64 oracle on the same rounded inputs); in fp16/bf16 its math
    # path may round the scores, the probabilities and the output to the input dtype: each counted.
    low = None if dtype == torch.float32 else dtype
    atol = attention_atol(batch, 0.125, scores=low, probs=low, out=low)
    torch.testing.assert_close(out.double(), naive_attention(**batch, scale=0.125), rtol=0, atol=atol)


def test_reference_decode_length_buckets():
    # Widely spread decode lengths take several padded calls; all must be right.
    seq_lens = [1, 2, 3, 9, 17, 33, 64, 65, 130, 260, 300]
    batch = make_batch([1] * len(seq_lens), seq_lens, 4, 1, 16, block_size=8, dtype=torch.float64, seed=5)
    torch.testing.assert_close(paged_attention_ref(**batch, scale=0.3), naive_attention(**batch, scale=0.3),
                               rtol=0, atol=attention_atol(batch, 0.3, compute=torch.float64))


def test_reference_out_and_padding_rows():
    batch = make_batch([1, 12], [20, 30], 4, 2, 32, seed=1)
    query = batch.pop("query")
    padded = torch.cat([query, torch.randn(3, 4, 32)])  # 3 padding tokens past query_start_loc[-1]
    out = torch.full_like(padded, float("nan"))
    res = paged_attention_ref(padded, **batch, scale=0.5, out=out)
    assert res is out
    torch.testing.assert_close(out[:13].double(), naive_attention(query, **batch, scale=0.5), rtol=0,
                               atol=attention_atol(dict(batch, query=query), 0.5))
    assert torch.isnan(out[13:]).all()  # a caller's out keeps its padding rows
    fresh = paged_attention_ref(padded, **batch, scale=0.5)
    assert torch.equal(fresh[:13], out[:13]) and torch.equal(fresh[13:], torch.zeros(3, 4, 32))


def test_reference_empty_and_zero_length_sequences():
    batch = make_batch([0, 2, 0], [5, 2, 0], 2, 1, 16, seed=2)
    out = paged_attention_ref(**batch, scale=1.0)
    torch.testing.assert_close(out.double(), naive_attention(**batch, scale=1.0), rtol=0,
                               atol=attention_atol(batch, 1.0))
    empty = make_batch([], [], 2, 1, 16)
    assert paged_attention_ref(**empty, scale=1.0).shape == (0, 2, 16)


def test_reference_workspace_inside_and_outside_inference_mode():
    # The gather workspace is reused across calls; it must work whichever mode created it.
    batch = make_batch([1, 1, 9], [70, 20, 80], 4, 2, 16, seed=9)
    expected = naive_attention(**batch, scale=0.3)
    with torch.inference_mode():
        batch_big = make_batch([1], [500], 4, 2, 16, seed=10)  # grows the workspace in inference mode
        paged_attention_ref(**batch_big, scale=0.3)
        inside = paged_attention_ref(**batch, scale=0.3)
    outside = paged_attention_ref(**batch, scale=0.3)
    torch.testing.assert_close(inside.double(), expected, rtol=0, atol=attention_atol(batch, 0.3))
    assert torch.equal(outside, inside)  # the same inputs through the same code: bitwise


def test_reference_strided_query():
    # query as a head-major tensor transposed to [T, Hq, D] (non-contiguous).
    batch = make_batch([1, 12, 3], [30, 40, 3], 4, 2, 16, seed=12)
    expected = naive_attention(**batch, scale=0.3)
    batch["query"] = batch["query"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not batch["query"].is_contiguous()
    torch.testing.assert_close(paged_attention_ref(**batch, scale=0.3).double(), expected, rtol=0,
                               atol=attention_atol(batch, 0.3))


def test_reference_non_contiguous_cache():
    batch = make_batch([1, 9], [40, 25], 4, 2, 16, seed=4)
    # e.g. K and V views of one [num_blocks, 2, block_size, Hkv, D] allocation
    both = torch.stack([batch["key_cache"], batch["value_cache"]], dim=1)
    expected = naive_attention(**batch, scale=0.3)
    batch["key_cache"], batch["value_cache"] = both[:, 0], both[:, 1]
    assert not batch["key_cache"].is_contiguous()
    torch.testing.assert_close(paged_attention_ref(**batch, scale=0.3).double(), expected, rtol=0,
                               atol=attention_atol(batch, 0.3))


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda b: b.update(query=b["query"][:, :3]), "multiple of num_kv_heads"),
        (lambda b: b.update(query=b["query"][..., :8]), "head_dim mismatch"),
        (lambda b: b.update(query=b["query"].half()), "must equal query dtype"),
        (lambda b: b.update(seq_lens=b["seq_lens"][:1]), "seq_lens must be 1-D"),
        (lambda b: b.update(query_start_loc=b["query_start_loc"].float()), "query_start_loc dtype"),
        (lambda b: b.update(key_cache=b["key_cache"][0]), "key_cache must be"),
        (lambda b: b.update(seq_lens=torch.tensor([1, 2], dtype=torch.int32)), "seq_lens must be >="),
        (lambda b: b.update(seq_lens=torch.tensor([1, 900], dtype=torch.int32)), "block_tables capacity"),
    ],
)
def test_reference_attention_errors(change, match):
    batch = make_batch([1, 3], [5, 9], 4, 2, 16)
    change(batch)
    with pytest.raises(ValueError, match=match):
        paged_attention_ref(**batch, scale=1.0)


# --------------------------------------------------------------------------- store_kv_ref


def test_store_kv_ref_writes_and_skips_negative():
    cache_k = torch.zeros(4, 8, 2, 16)
    cache_v = torch.zeros(4, 8, 2, 16)
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([3, -1, 17, 31, -5])
    store_kv_ref(key, value, cache_k, cache_v, slots)
    assert torch.equal(cache_k[0, 3], key[0]) and torch.equal(cache_v[2, 1], value[2])
    assert torch.equal(cache_k[3, 7], key[3])
    assert int((cache_k != 0).any(-1).any(-1).sum()) == 3  # exactly three slots written


def test_store_kv_ref_casts_and_handles_strided_cache():
    both = torch.zeros(3, 2, 4, 1, 8, dtype=torch.bfloat16)
    key_cache, value_cache = both[:, 0], both[:, 1]
    key, value = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    store_kv_ref(key, value, key_cache, value_cache, torch.tensor([5, 0], dtype=torch.int32))
    assert torch.equal(key_cache[1, 1], key[0].bfloat16()) and torch.equal(value_cache[0, 0], value[1].bfloat16())


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.randn(2, 16), torch.randn(2, 16)), "key must be"),
        ((torch.randn(2, 3, 16), torch.randn(2, 3, 16)), "does not match"),
        ((torch.randn(2, 2, 16), torch.randn(3, 2, 16)), "value shape"),
    ],
)
def test_store_kv_ref_errors(args, match):
    cache = torch.zeros(2, 4, 2, 16)
    with pytest.raises(ValueError, match=match):
        store_kv_ref(*args, cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping dtype"):
        store_kv_ref(torch.randn(2, 2, 16), torch.randn(2, 2, 16), cache, cache.clone(), torch.tensor([0.0, 1.0]))


# --------------------------------------------------------------------------- dispatch


def test_resolve_backend(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.resolve_backend(None, t) == "cpu"
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.resolve_backend(None, t) == "triton"
    assert dispatch.resolve_backend("torch", t) == "torch"  # explicit argument wins
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert dispatch.resolve_backend(None, t) == "cpu"
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=dispatch.ENV_VAR):
        dispatch.resolve_backend(None, t)
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.resolve_backend("flash", t)


def test_dispatch_torch_backend(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    batch = make_batch([1, 4], [9, 4], 2, 1, 16, seed=8)
    torch.testing.assert_close(dispatch.paged_attention(**batch, scale=0.7).double(),
                               naive_attention(**batch, scale=0.7), rtol=0, atol=attention_atol(batch, 0.7))
    cache_k, cache_v = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    key = torch.randn(1, 1, 16)
    dispatch.store_kv(key, key, cache_k, cache_v, torch.tensor([6]))
    assert torch.equal(cache_k[1, 2], key[0])


@pytest.mark.slow
def test_import_dispatch_does_not_import_triton():
    code = "import sys, kernels.dispatch; kernels.dispatch.paged_attention; print('triton' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert res.stdout.strip() == "False"


def test_kernels_is_a_plain_package():
    """No module-class tricks: submodules bind as attributes, the dispatch functions live in one module."""
    import types

    import kernels.paged_attention  # noqa: F401
    from kernels.store_kv import store_kv_triton  # noqa: F401

    assert type(kernels) is types.ModuleType
    assert isinstance(kernels.paged_attention, types.ModuleType)
    assert kernels.dispatch.paged_attention.__module__ == "kernels.dispatch"
    assert kernels.dispatch.store_kv.__module__ == "kernels.dispatch"
