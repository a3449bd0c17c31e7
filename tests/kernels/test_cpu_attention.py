"""kernels/cpu_attention: the C kernel for short queries (decode) on a CPU, against the float64 oracle, through
the dispatch the model runner uses, and the fall-back to the torch path when it cannot be built."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from kernels import cpu_attention, dispatch
from kernels.reference import MAX_BATCHED_QUERY_LEN, paged_attention_ref
from tests.kernels.test_reference import make_batch, naive_attention, random_lengths
from tests.tolerances import attention_atol

HAVE_CC = shutil.which(os.environ.get("CC") or "cc") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine: the torch path serves (tested below)")


def _kernel_attention(batch, scale, out=None):
    return dispatch.paged_attention(**batch, scale=scale, out=out, backend="cpu")


@needs_cc
def test_the_kernel_builds_where_a_compiler_is():
    assert cpu_attention.kernel() is not None, cpu_attention.failure()


@needs_cc
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 32), ((9, 3), 64), ((8, 2), 80), ((6, 1), 16), ((4, 2), 128)])
def test_kernel_matches_naive_on_mixed_batches(seed, heads, head_dim, monkeypatch):
    """Decode, short multi-token queries (through the kernel) and prefills (SDPA) in one batch, GQA groups
    of 1-6, head sizes that are and are not a multiple of the vector width, block sizes 16, 4 and 5."""
    calls = []
    real = cpu_attention.short_query_attention
    monkeypatch.setattr(cpu_attention, "short_query_attention", lambda *a: calls.append(a[5]) or real(*a))
    rng = torch.Generator().manual_seed(300 + seed)
    q_lens, seq_lens = random_lengths(rng, num_seqs=int(torch.randint(2, 14, (1,), generator=rng)), max_len=90)
    q_lens[0], seq_lens[0] = 1, 57  # at least one decode row every time
    batch = make_batch(q_lens, seq_lens, *heads, head_dim=head_dim, block_size=[16, 4, 5][seed % 3], seed=seed)
    out = _kernel_attention(batch, 0.2)
    torch.testing.assert_close(out.double(), naive_attention(**batch, scale=0.2), rtol=0,
                               atol=attention_atol(batch, 0.2))
    short = sorted(s for s, q in enumerate(q_lens) if 0 < q <= MAX_BATCHED_QUERY_LEN)
    assert len(calls) == 1 and sorted(calls[0]) == short  # every short query in one call, nothing else


@needs_cc
def test_kernel_long_contexts_and_large_scores():
    """Hundreds of blocks per sequence and scores up to ~100 (the running max moves many times: the online
    softmax must rescale what it summed before), in the runner's query layout (a transposed view)."""
    seq_lens = [1, 15, 16, 17, 700, 1031]
    batch = make_batch([1, 2, 1, 8, 1, 3], seq_lens, 8, 2, 64, seed=7)
    batch["query"] = (batch["query"] * 3).transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D], rows strided
    assert batch["query"].stride(2) == 1 and not batch["query"].is_contiguous()
    ramp = torch.linspace(0, 4, batch["key_cache"].shape[0])[:, None, None, None]
    batch["key_cache"] = (batch["key_cache"] * ramp).contiguous()  # later blocks score higher, in a shuffled order
    out = _kernel_attention(batch, 0.125)
    torch.testing.assert_close(out.double(), naive_attention(**batch, scale=0.125), rtol=0,
                               atol=attention_atol(batch, 0.125))


@needs_cc
def test_kernel_leaves_a_callers_padding_rows_alone():
    batch = make_batch([1, 3], [20, 30], 4, 2, 32, seed=1)
    query = batch.pop("query")
    padded = torch.cat([query, torch.randn(3, 4, 32)])
    out = torch.full_like(padded, float("nan"))
    res = dispatch.paged_attention(padded, **batch, scale=0.5, out=out, backend="cpu")
    assert res is out and torch.isnan(out[4:]).all() and not torch.isnan(out[:4]).any()
    torch.testing.assert_close(out[:4], paged_attention_ref(query, **batch, scale=0.5), rtol=0, atol=1e-5)


def test_only_fp32_cpu_layouts_take_the_kernel():
    b = make_batch([1], [9], 4, 2, 32)
    assert cpu_attention.usable(b["query"], b["key_cache"], b["value_cache"], b["block_tables"])
    half = {k: (v.half() if v.is_floating_point() else v) for k, v in b.items()}
    assert not cpu_attention.usable(half["query"], half["key_cache"], half["value_cache"], half["block_tables"])
    assert not cpu_attention.usable(b["query"], b["key_cache"], b["value_cache"], b["block_tables"].long())
    assert not cpu_attention.usable(b["query"], b["key_cache"].transpose(1, 2), b["value_cache"], b["block_tables"])


def test_auto_and_cpu_use_the_kernel_torch_never(monkeypatch):
    """The runner's backend None on CPU tensors is "cpu" (the kernel for decode); "torch", explicit or from the
    environment, is the pure reference the Triton kernels are tested against."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    seen = []
    monkeypatch.setattr(cpu_attention, "kernel", lambda: object())
    monkeypatch.setattr(cpu_attention, "short_query_attention", lambda *a: seen.append(a[5]))
    b = make_batch([1, 1], [9, 40], 4, 2, 32)
    dispatch.paged_attention(**b, scale=0.5)
    assert seen == [[1, 0]] or seen == [[0, 1]]
    seen.clear()
    dispatch.paged_attention(**b, scale=0.5, backend="torch")
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    dispatch.paged_attention(**b, scale=0.5)
    assert seen == []


def test_without_a_compiler_the_torch_path_serves(monkeypatch, tmp_path, caplog):
    """No compiler (or a failing build): one warning naming why, kernel() None, and every call still answered
    right, by the torch path."""
    monkeypatch.setattr(cpu_attention, "_fn", None)
    monkeypatch.setattr(cpu_attention, "_failure", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
        assert cpu_attention.kernel() is None and cpu_attention.kernel() is None
    assert "no-such-cc" in cpu_attention.failure()
    assert len([r for r in caplog.records if "kernel unavailable" in r.message]) == 1
    b = make_batch([1, 5, 20], [33, 40, 20], 4, 2, 32, seed=2)
    torch.testing.assert_close(dispatch.paged_attention(**b, scale=0.3).double(), naive_attention(**b, scale=0.3),
                               rtol=0, atol=attention_atol(b, 0.3))


@needs_cc
def test_a_failing_build_is_reported_and_nothing_half_written_stays(monkeypatch, tmp_path):
    script = tmp_path / "cc"
    script.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                      "echo 'error: broken compiler' >&2; exit 3\n")
    script.chmod(0o755)
    monkeypatch.setattr(cpu_attention, "_fn", None)
    monkeypatch.setattr(cpu_attention, "_failure", None)
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "cache"))
    assert cpu_attention.kernel() is None
    assert "broken compiler" in cpu_attention.failure() and "(3)" in cpu_attention.failure()
    assert list((tmp_path / "cache").iterdir()) == []
