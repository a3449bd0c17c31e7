"""omni/bench/kernels.py: clean skip without CUDA; the measurement logic on CPU (interpreter)."""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch

from kernels.store_kv import interpreting
from omni.bench import kernels as bench
from tests.tolerances import attention_bound


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_follow_the_issue():
    args = bench.resolve_shape(_args())
    assert (args.batch, args.context, args.prefill_tokens) == (64, 4096, 4096)
    assert (args.num_q_heads // args.num_kv_heads, args.head_dim, args.dtype) == (4, 128, "bf16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_run_without_cuda_is_a_clean_skip():
    res = bench.run(_args())
    assert res["gpu"] is None and "CUDA" in res["skipped"]
    json.dumps(res)


@pytest.mark.parametrize(
    "name,peak",
    [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H200", 4.8e12),
     ("NVIDIA GH200 480GB", 4.0e12), ("NVIDIA A100-SXM4-80GB", 2.039e12), ("NVIDIA L40S", 0.864e12),
     ("NVIDIA L4", 0.3e12), ("Some Future GPU", None)],
)
def test_peak_table(name, peak):
    assert bench.peak_bandwidth(name) == peak


def _wall_ms(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@pytest.mark.slow
@pytest.mark.skipif(not interpreting(), reason="runs the Triton kernels on CPU tensors")
def test_measure_logic_on_cpu_interpreter():
    args = _args("--batch", "2", "--context", "40", "--prefill-tokens", "24", "--num-q-heads", "4",
                 "--num-kv-heads", "1", "--head-dim", "16", "--block-size", "8", "--dtype", "fp32")
    res = bench.measure(args, device="cpu", bench=_wall_ms, gpu_name="NVIDIA H100 80GB HBM3", copy_bytes=1 << 16)
    json.dumps(res)
    # fp32 Triton vs SDPA on the bench's seeded randn inputs: head_dim 16, at most 40 keys; with
    # |q|, |k|, |v| <= 6 (P(|N(0,1)| > 6) ~ 2e-9 per draw), sum|q_i k_i| <= 16 * 36.
    atol = attention_bound(16, 40, 16 * 36.0, 6.0, 16**-0.5)
    assert res["decode"]["max_abs_err_vs_sdpa"] <= atol and res["prefill"]["max_abs_err_vs_sdpa"] <= atol
    assert res["decode"]["kv_bytes"] == 2 * 2 * 40 * 1 * 16 * 4
    assert res["decode_bandwidth_fraction"] > 0 and res["prefill_time_vs_sdpa"] > 0
    assert res["peak_bandwidth_gbps"] == 3350.0


def test_sweep_keeps_best_and_reports_failures():
    from kernels.paged_attention import AttentionConfig

    times = {16: 3.0, 32: 1.0}

    def run_cfg(cfg):
        if cfg.tile == 64:
            raise RuntimeError("out of shared memory")
        return times[cfg.tile]

    best, rows = bench._sweep(lambda fn: fn(), run_cfg, [AttentionConfig(tile=t) for t in (16, 32, 64)])
    assert best[0].tile == 32 and best[1] == 1.0
    assert "shared memory" in rows[2]["error"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_run_on_gpu_small():
    res = bench.run(_args("--batch", "4", "--context", "512", "--prefill-tokens", "512"))
    json.dumps(res)
    assert res["gpu"] and res["decode_bandwidth_fraction"] > 0 and res["prefill_time_vs_sdpa"] > 0
    assert res["decode"]["max_abs_err_vs_sdpa"] < 2e-2 and res["prefill"]["max_abs_err_vs_sdpa"] < 2e-2


def test_cpu_mode_times_both_decode_paths_on_smollm2_shapes():
    """`omni bench kernels --cpu`: the torch path and the C kernel on one decode batch (SmolLM2's heads unless
    given), their outputs within float rounding of each other; flags given keep their values."""
    from kernels import cpu_attention

    if cpu_attention.kernel() is None:
        res = bench.run(_args("--cpu"))
        assert res["cpu_kernel"] is None and cpu_attention.failure() in res["skipped"]
        return
    res = bench.run(_args("--cpu", "--batch", "6", "--context", "80", "--repeats", "2"))
    json.dumps(res)
    assert (res["batch"], res["num_q_heads"], res["num_kv_heads"], res["head_dim"]) == (6, 9, 3, 64)
    assert 20 <= res["context_mean"] <= 80
    assert res["torch_ms"] > 0 and res["kernel_ms"] > 0 and res["cpu_kernel_speedup"] > 0
    assert res["max_abs_diff"] < 1e-5
    with pytest.raises(ValueError, match="fp32"):
        bench.run(_args("--cpu", "--dtype", "bf16"))
