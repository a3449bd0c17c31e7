"""Triton paged attention (interpreter on CPU; real kernels on CUDA) against the reference.

Shapes are small (the interpreter runs every program in Python): a handful of
sequences, head_dim <= 64, large tiles.
"""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels.paged_attention import AttentionConfig, paged_attention_triton
from kernels.reference import paged_attention_ref
from tests.kernels.test_reference import make_batch, naive_attention
from tests.tolerances import attention_atol

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# decode (short, long, length 1), full prefill, chunked prefill on a prefix,
# a short multi-token query, a decode right at a block boundary.
MIXED_Q = [1, 1, 7, 1, 23, 40, 3, 1]
MIXED_SEQ = [13, 70, 7, 1, 50, 40, 3, 32]


def _to(batch, device=DEVICE):
    return {k: v.to(device) for k, v in batch.items()}


def _reference_fp32(batch, scale):
    """Reference on the same (rounded) inputs, computed in fp32."""
    b = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
    return paged_attention_ref(**b, scale=scale)


def assert_close_to_reference(out, batch, scale):
    batch = {k: v.cpu() for k, v in batch.items()}
    expected = _reference_fp32(batch, scale)
    out = out.cpu()
    # Both accumulate in fp32 (inputs already rounded alike); a low-precision kernel stores its output
    # in its dtype and, on a GPU, rounds the probabilities to it before P @ V. The interpreter may
    # truncate instead of rounding: attention_atol counts one whole ulp at the store.
    low = None if out.dtype == torch.float32 else out.dtype
    atol = attention_atol(batch, scale, probs=low if DEVICE == "cuda" else None, out=low)
    err = (out.float() - expected).abs().max().item()
    assert err <= atol, f"{out.dtype}: max |diff| {err:.3g} > atol {atol:.3g}"


@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 2), (3, 1)], ids=["gqa1", "gqa2", "gqa4", "mqa3"])
def test_mixed_batch_gqa(heads):
    batch = _to(make_batch(MIXED_Q, MIXED_SEQ, *heads, head_dim=32, seed=sum(heads)))
    out = dispatch.paged_attention(**batch, scale=0.17, backend="triton")
    assert_close_to_reference(out, batch, 0.17)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_mixed_batch_low_precision(dtype):
    batch = _to(make_batch(MIXED_Q, MIXED_SEQ, 4, 2, 32, dtype=dtype, seed=11))
    out = dispatch.paged_attention(**batch, scale=0.17, backend="triton")
    assert out.dtype == dtype
    assert_close_to_reference(out, batch, 0.17)


@pytest.mark.parametrize("head_dim,block_size", [(16, 5), (48, 16), (64, 8)])
def test_head_dims_and_block_sizes(head_dim, block_size):
    # 48 is padded to 64 with masks; block_size 5 is not a power of two.
    batch = _to(make_batch([1, 9, 1], [21, 30, 40], 4, 2, head_dim, block_size=block_size, seed=head_dim))
    out = paged_attention_triton(**batch, scale=head_dim**-0.5)
    assert_close_to_reference(out, batch, head_dim**-0.5)


@pytest.mark.parametrize("config", [AttentionConfig(block_m=16, tile=16), AttentionConfig(block_m=32, tile=32)],
                         ids=["m16t16", "m32t32"])
def test_small_tiles_many_programs(config):
    # Query blocks split inside long prefills and tiles cross block boundaries.
    batch = _to(make_batch([1, 20, 5], [37, 44, 5], 4, 2, 16, seed=21))
    out = paged_attention_triton(**batch, scale=0.3, config=config)
    assert_close_to_reference(out, batch, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_kv_decode(dtype):
    batch = _to(make_batch([1, 1, 1], [300, 17, 150], 4, 1, 32, dtype=dtype, seed=31))
    out = paged_attention_triton(**batch, scale=0.2, config=AttentionConfig(num_segments=4))
    assert_close_to_reference(out, batch, 0.2)


@pytest.mark.slow
def test_split_kv_mixed_batch_with_padding_rows():
    # Split-KV is valid for any batch; segments with no visible key merge as empty.
    batch = make_batch([1, 6, 1], [90, 6, 2], 2, 1, 16, seed=41)
    query = batch.pop("query")
    padded = torch.cat([query, torch.zeros(2, 2, 16)])
    out = torch.full_like(padded, 7.0)
    res = paged_attention_triton(padded.to(DEVICE), **_to(batch), scale=0.4, out=out.to(DEVICE),
                                 config=AttentionConfig(num_segments=8, tile=16))
    expected = naive_attention(query, **batch, scale=0.4).float()
    atol = attention_atol(dict(batch, query=query), 0.4)
    torch.testing.assert_close(res[:8].cpu(), expected, rtol=0, atol=atol)
    assert torch.equal(res[8:].cpu(), torch.full((2, 2, 16), 7.0))  # padding rows untouched


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_mixed_batches(seed):
    """Random mixed batches x dtype x GQA ratio x head_dim x block size x tiling (incl. split-KV)."""
    from tests.kernels.test_reference import random_lengths

    rng = torch.Generator().manual_seed(1000 + seed)
    pick = lambda options: options[int(torch.randint(0, len(options), (1,), generator=rng))]  # noqa: E731
    q_lens, seq_lens = random_lengths(rng, num_seqs=pick([1, 3, 6, 8]), max_len=100)
    heads = [(2, 2), (4, 2), (8, 2), (6, 2)][seed % 4]
    dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
    head_dim = pick([16, 32, 64, 40])
    config = pick([AttentionConfig(), AttentionConfig(block_m=16, tile=16), AttentionConfig(block_m=32, tile=32),
                   AttentionConfig(num_segments=2), AttentionConfig(block_m=16, tile=16, num_segments=4)])
    batch = _to(make_batch(q_lens, seq_lens, *heads, head_dim=head_dim, block_size=pick([16, 4, 7, 32]),
                           dtype=dtype, seed=seed))
    out = paged_attention_triton(**batch, scale=head_dim**-0.5, config=config)
    assert_close_to_reference(out, batch, head_dim**-0.5)


@pytest.mark.slow
def test_head_dim_128_bf16():
    batch = _to(make_batch([1, 1, 30], [100, 33, 60], 8, 2, 128, dtype=torch.bfloat16, seed=81))
    out = dispatch.paged_attention(**batch, scale=128**-0.5, backend="triton")
    assert_close_to_reference(out, batch, 128**-0.5)


@pytest.mark.parametrize("heads,block_m", [((8, 1), 16), ((3, 1), 64), ((16, 2), 16)],
                         ids=["g8-bq2", "g3-bq21", "g8-h16"])
def test_group_packing(heads, block_m):
    # Rows are (token, group member) pairs; BLOCK_M // G tokens per program,
    # with dead rows when G does not divide BLOCK_M.
    batch = _to(make_batch([1, 11, 1], [9, 25, 30], *heads, 16, seed=91))
    out = paged_attention_triton(**batch, scale=0.3, config=AttentionConfig(block_m=block_m, tile=16))
    assert_close_to_reference(out, batch, 0.3)


def test_prefix_hit_matches_full_prefill():
    # A prompt computed in one go and the same prompt whose first 32 tokens come
    # from the (shared) prefix cache must give the same last-16-token outputs.
    batch = make_batch([48], [48], 4, 2, 32, seed=51)
    full = paged_attention_triton(**_to(batch), scale=0.2)
    hit = dict(batch, query=batch["query"][32:], query_start_loc=torch.tensor([0, 16], dtype=torch.int32))
    tail = paged_attention_triton(**_to(hit), scale=0.2)
    # The same kernel and tiles, but the hit's query blocks start 32 rows later: bound, not equality.
    torch.testing.assert_close(tail, full[32:], rtol=0, atol=attention_atol(batch, 0.2))


def test_zero_length_and_offset_query_start():
    # query_start_loc need not start at 0; empty sequences produce nothing.
    batch = make_batch([0, 3, 0, 1], [4, 3, 0, 9], 2, 1, 16, seed=61)
    batch["query_start_loc"] = batch["query_start_loc"] + 2
    batch["query"] = torch.cat([torch.zeros(2, 2, 16), batch["query"]])
    out = paged_attention_triton(**_to(batch), scale=0.5)
    torch.testing.assert_close(out.cpu(), paged_attention_ref(**batch, scale=0.5), rtol=0,
                               atol=attention_atol(batch, 0.5))


def test_strided_query_and_out():
    # query as a view into a fused qkv projection; out as a view too.
    batch = make_batch([1, 5], [9, 5], 4, 2, 16, seed=71)
    qkv = torch.randn(6, 8, 16)
    qkv[:, :4] = batch["query"]
    out_buf = torch.zeros(6, 8, 16)
    strided = dict(batch, query=qkv[:, :4])
    out = paged_attention_triton(**_to(strided), scale=0.5, out=out_buf[:, 2:6].to(DEVICE))
    torch.testing.assert_close(out.cpu(), paged_attention_ref(**batch, scale=0.5), rtol=0,
                               atol=attention_atol(batch, 0.5))


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda b: b.update(query=b["query"][:, :3]), "multiple of num_kv_heads"),
        (lambda b: b.update(value_cache=b["value_cache"][:, :4]), "value_cache shape"),
        (lambda b: b.update(key_cache=b["key_cache"].half(), value_cache=b["value_cache"].half()),
         "must equal query dtype"),
        (lambda b: b.update(block_tables=b["block_tables"][0]), "block_tables must be"),
        (lambda b: b.update(**{k: b[k].double() for k in ("query", "key_cache", "value_cache")}),
         "for the Triton backend"),
        (lambda b: b.update(query_start_loc=b["query_start_loc"].new_zeros(6)[::2]), "must be contiguous"),
        (lambda b: b.update(out=b["query"].new_zeros(1, 4, 16)), "out must match query"),
        (lambda b: b.update(seq_lens=b["seq_lens"].cpu() if DEVICE != "cpu" else b["seq_lens"].to("meta")),
         "one device"),
    ],
)
def test_launcher_errors(change, match):
    batch = _to(make_batch([1, 3], [5, 9], 4, 2, 16))
    batch["out"] = None
    change(batch)
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(**batch, scale=1.0)


def test_launcher_rejects_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        paged_attention_triton(**make_batch([1], [3], 2, 1, 16), scale=1.0)


def test_bad_config():
    with pytest.raises(ValueError, match="tile must be a power of two"):
        paged_attention_triton(**_to(make_batch([1], [3], 2, 1, 16)), scale=1.0, config=AttentionConfig(tile=24))
