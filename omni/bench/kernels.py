"""`omni bench kernels`: Triton paged attention vs torch SDPA on one GPU.

Workloads (defaults follow issue 4): decode at batch 64 x 4k context and a
4k-token prefill, head_dim 128, GQA 4 (32 query / 8 KV heads), bf16, block
size 16 with shuffled (non-contiguous) block tables. SDPA runs on the same K/V
gathered into contiguous [B, Hkv, L, D] tensors (its best case: no paging),
with native GQA or with K/V repeated to all heads, whichever is faster.

Reported: median times (triton.testing.do_bench), decode bandwidth = bytes of
K/V read / time, as a fraction of the GPU's peak HBM bandwidth (table below;
a measured device-to-device copy bandwidth is reported too and used when the
GPU is not in the table), prefill time relative to SDPA. Targets: decode >= 60%
of peak, prefill <= 1.5x SDPA. Without CUDA it returns
{"gpu": null, "skipped": "..."} instead of failing.

With ``--cpu``: the CPU's decode attention instead (no GPU needed), on SmolLM2-135M's attention shapes
unless given (32 sequences, contexts spread over [context/4, context] with context 512, 9 query / 3 KV
heads of 64, fp32, block size 16, shuffled blocks): the torch path (reference.py: each sequence's blocks
gathered into a contiguous copy, then padded SDPA) vs the C kernel reading the blocks in place
(cpu_attention.py), at the process's thread count; median of repeats, `cpu_kernel_speedup`, the bytes
of K/V read per second, and the largest difference between the two.

Usable on its own: ``python -m omni.bench.kernels [--sweep | --cpu]`` (JSON on the last line).
"""

from __future__ import annotations

import argparse
import json
import math

# Peak HBM/GDDR bandwidth in bytes/s by device-name substrings; first match wins
# (so "GH200" must come before "H200", "PCIe"/"NVL" variants before plain H100).
PEAK_BANDWIDTH: list[tuple[tuple[str, ...], float]] = [
    (("GH200",), 4.0e12),
    (("H200",), 4.8e12),
    (("H100", "PCIE"), 2.0e12),
    (("H100", "NVL"), 3.9e12),
    (("H100",), 3.35e12),  # SXM5, "NVIDIA H100 80GB HBM3"
    (("H800",), 3.35e12),
    (("H20",), 4.0e12),
    (("B200",), 8.0e12),
    (("A100", "80GB", "PCIE"), 1.935e12),
    (("A100", "80GB"), 2.039e12),
    (("A100",), 1.555e12),
    (("L40S",), 0.864e12),
    (("L40",), 0.864e12),
    (("L4",), 0.3e12),
    (("A10G",), 0.6e12),
    (("A10",), 0.6e12),
    (("RTX 4090",), 1.008e12),
    (("V100",), 0.9e12),
    (("T4",), 0.32e12),
]

DECODE_TARGET = 0.60
PREFILL_TARGET = 1.5


def peak_bandwidth(name: str) -> float | None:
    upper = name.upper()
    for keys, peak in PEAK_BANDWIDTH:
        if all(k in upper for k in keys):
            return peak
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The shape flags default to None: `resolve_shape` fills GPU_DEFAULTS, or with --cpu CPU_DEFAULTS.
    parser.add_argument("--batch", type=int, help="decode batch size (sequences; GPU 64, --cpu 32)")
    parser.add_argument("--context", type=int, help="decode context length per sequence (GPU 4096, --cpu 512)")
    parser.add_argument("--prefill-tokens", type=int, help="tokens of the single prefill sequence (4096)")
    parser.add_argument("--num-q-heads", type=int, help="GPU 32, --cpu 9")
    parser.add_argument("--num-kv-heads", type=int, help="GPU 8, --cpu 3")
    parser.add_argument("--head-dim", type=int, help="GPU 128, --cpu 64")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="GPU bf16, --cpu fp32")
    parser.add_argument("--sweep", action="store_true",
                        help="also time a grid of tile/warp/stage configurations and report the best")
    parser.add_argument("--write-config", nargs="?", const="default", default=None, metavar="PATH",
                        help="with --sweep: merge the fastest decode and prefill configurations for this GPU "
                             "into PATH (default kernels/configs/paged_attention.json), where launches pick "
                             "them up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true",
                        help="time the CPU's decode attention (torch path vs the C kernel) instead; the shape "
                             "flags default to SmolLM2-135M's (see the module docstring)")
    parser.add_argument("--repeats", type=int, default=30, help="with --cpu: timed calls of each path")


def _bench(fn) -> float:
    """Median milliseconds."""
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except TypeError:  # older triton without return_mode
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5])[0])


def _paged_batch(dev: str, seq_lens: list[int], q_lens: list[int], hq: int, hkv: int, d: int,
                 block_size: int, dtype, gen):
    """Random K/V in a paged cache with shuffled block tables."""
    import torch

    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, device=dev, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32, device=dev)
    used = 0
    for s, n in enumerate(need):
        block_tables[s, :n] = perm[used:used + n].int()
        used += n
    key_cache = torch.randn(num_blocks, block_size, hkv, d, device=dev, dtype=dtype, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, hkv, d, device=dev, dtype=dtype, generator=gen)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=dev)
    qsl[1:] = torch.tensor(q_lens, device=dev).cumsum(0)
    query = torch.randn(sum(q_lens), hq, d, device=dev, dtype=dtype, generator=gen)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev))


def _contiguous_kv(batch, length: int):
    """[B, Hkv, L, D] copies of each sequence's K/V (all sequences have ``length`` tokens)."""
    bt = batch["block_tables"].long()
    block_size = batch["key_cache"].shape[1]
    out = []
    for cache in (batch["key_cache"], batch["value_cache"]):
        g = cache[bt]  # [B, nblk, block_size, Hkv, D]
        b, nblk, _, hkv, d = g.shape
        out.append(g.reshape(b, nblk * block_size, hkv, d)[:, :length].transpose(1, 2).contiguous())
    return out


def _time_sdpa(bench, q, k, v, causal: bool) -> tuple[float, str, object]:
    """Fastest of SDPA with native GQA and SDPA on K/V repeated to all query heads
    (some backends lack GQA and would fall back to the math kernel).

    Returns (ms, variant, output).
    """
    import torch.nn.functional as F

    rep = q.shape[1] // k.shape[1]
    variants = {"expanded": lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=causal)}
    if rep > 1:
        variants["gqa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    kx, vx = (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)) if rep > 1 else (k, v)
    best = None
    for name, fn in variants.items():
        try:
            ms = bench(fn)
        except (RuntimeError, TypeError):
            continue
        if best is None or ms < best[0]:
            best = (ms, name, fn)
    if best is None:
        raise RuntimeError("torch SDPA failed for every variant")
    out = best[2]()
    del kx, vx
    return best[0], best[1], out


def _sweep(bench, run_cfg, candidates):
    best = None
    results = []
    for cfg in candidates:
        try:
            ms = bench(lambda: run_cfg(cfg))
        except Exception as exc:  # a config may not compile/fit (shared memory, registers)
            results.append({"config": _cfg_dict(cfg), "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        results.append({"config": _cfg_dict(cfg), "ms": ms})
        if best is None or ms < best[1]:
            best = (cfg, ms)
    return best, results


def _cfg_dict(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("block_m", "tile", "num_segments", "num_warps", "num_stages")}


# issue 4's workloads on a GPU; with --cpu SmolLM2-135M's decode attention
GPU_DEFAULTS = {"batch": 64, "context": 4096, "prefill_tokens": 4096, "num_q_heads": 32, "num_kv_heads": 8,
                "head_dim": 128, "dtype": "bf16"}
CPU_DEFAULTS = {**GPU_DEFAULTS, "batch": 32, "context": 512, "num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64,
                "dtype": "fp32"}


def resolve_shape(args: argparse.Namespace) -> argparse.Namespace:
    """The shape flags not given take their mode's defaults."""
    for name, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def run_cpu(args: argparse.Namespace) -> dict:
    """The CPU's decode attention: the torch path vs the C kernel on one decode batch (see the docstring)."""
    import statistics
    import time

    import torch

    from kernels import cpu_attention
    from kernels.reference import paged_attention_ref

    resolve_shape(args)
    if args.dtype != "fp32":
        raise ValueError(f"--dtype: the CPU kernel reads fp32 caches only (got {args.dtype})")
    fn = cpu_attention.kernel()
    if fn is None:
        return {"cpu_kernel": None, "skipped": f"the CPU kernel cannot be built here: {cpu_attention.failure()}"}
    gen = torch.Generator().manual_seed(args.seed)
    lo = max(1, args.context // 4)
    seq_lens = torch.randint(lo, args.context + 1, (args.batch,), generator=gen).tolist()
    batch = _paged_batch("cpu", seq_lens, [1] * args.batch, args.num_q_heads, args.num_kv_heads, args.head_dim,
                         args.block_size, torch.float32, gen)
    scale = args.head_dim ** -0.5
    paths = {"torch": lambda: paged_attention_ref(**batch, scale=scale),
             "kernel": lambda: paged_attention_ref(**batch, scale=scale,
                                                   short_queries=cpu_attention.short_query_attention)}
    outs = {name: f() for name, f in paths.items()}  # warm-up (the gather workspace, the threads)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(max(1, args.repeats)):
        for name, f in paths.items():  # in turn, so that both see the same machine
            t0 = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t0) * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    kv_bytes = 2 * sum(seq_lens) * args.num_kv_heads * args.head_dim * 4
    return {"cpu_kernel": True, "threads": torch.get_num_threads(), "batch": args.batch,
            "context_mean": sum(seq_lens) / len(seq_lens), "num_q_heads": args.num_q_heads,
            "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim, "block_size": args.block_size,
            "torch_ms": ms["torch"], "kernel_ms": ms["kernel"], "cpu_kernel_speedup": ms["torch"] / ms["kernel"],
            "kernel_kv_gb_per_s": kv_bytes / (ms["kernel"] / 1e3) / 1e9,
            "max_abs_diff": float((outs["torch"] - outs["kernel"]).abs().max())}


def run(args: argparse.Namespace) -> dict:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return {"gpu": None, "skipped": "torch is not installed"}
    resolve_shape(args)
    if args.cpu:
        return run_cpu(args)
    if not torch.cuda.is_available():
        return {"gpu": None, "skipped": "no CUDA device: the kernel benchmark needs a GPU"}
    try:
        import triton
    except ImportError:
        return {"gpu": torch.cuda.get_device_name(), "skipped": "triton is not installed"}
    return measure(args, device="cuda", bench=_bench, gpu_name=torch.cuda.get_device_name())


def measure(args: argparse.Namespace, device: str, bench, gpu_name: str, copy_bytes: int = 1 << 29) -> dict:
    """The benchmark proper; ``bench(fn) -> ms``. Tests run it on CPU under the interpreter."""
    import torch
    import triton

    from kernels.paged_attention import AttentionConfig, paged_attention_triton

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    hq, hkv, d, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    if hq % hkv:
        raise ValueError(f"--num-q-heads ({hq}) must be a multiple of --num-kv-heads ({hkv})")
    scale = d**-0.5
    gen = torch.Generator(device=device).manual_seed(args.seed)
    elem = torch.finfo(dtype).bits // 8
    result: dict = {
        "gpu": gpu_name, "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
        "shape": {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "block_size": bs},
    }

    # Device-to-device copy: a practical ceiling for the bandwidth numbers.
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() / (copy_ms * 1e-3)
    del src, dst
    peak = peak_bandwidth(gpu_name)
    result["peak_bandwidth_gbps"] = peak / 1e9 if peak else None
    result["copy_bandwidth_gbps"] = round(copy_bw / 1e9, 1)
    ref_bw = peak or copy_bw

    # ---------------------------------------------------------------- decode
    b, ctx = args.batch, args.context
    batch = _paged_batch(device, [ctx] * b, [1] * b, hq, hkv, d, bs, dtype, gen)
    out = torch.empty_like(batch["query"])
    kv_bytes = 2 * b * ctx * hkv * d * elem

    def decode(cfg=None):
        return paged_attention_triton(**batch, scale=scale, out=out, config=cfg)

    t_dec = bench(decode)
    k, v = _contiguous_kv(batch, ctx)
    q4 = batch["query"].view(b, hq, 1, d)
    t_dec_sdpa, variant, ref = _time_sdpa(bench, q4, k, v, causal=False)
    err = (decode().float() - ref.view(b, hq, d).float()).abs().max().item()
    del k, v, ref
    dec = {
        "batch": b, "context": ctx, "kv_bytes": kv_bytes,
        "triton_ms": t_dec, "sdpa_ms": t_dec_sdpa, "sdpa_variant": variant,
        "triton_gbps": kv_bytes / (t_dec * 1e-3) / 1e9, "sdpa_gbps": kv_bytes / (t_dec_sdpa * 1e-3) / 1e9,
        "max_abs_err_vs_sdpa": err,
    }
    if args.sweep:
        cands = [AttentionConfig(block_m=16, tile=t, num_warps=w, num_stages=s, num_segments=g)
                 for t in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4) for g in (1, 2)
                 if not (t == 128 and s == 4)]
        best, rows = _sweep(bench, decode, cands)
        dec["sweep"] = rows
        if best:
            dec["best_config"], dec["best_ms"] = _cfg_dict(best[0]), best[1]
    dec_time = min(t_dec, dec.get("best_ms", t_dec))
    result["decode"] = dec
    result["decode_bandwidth_fraction"] = kv_bytes / (dec_time * 1e-3) / ref_bw
    result["decode_bandwidth_fraction_default_config"] = kv_bytes / (t_dec * 1e-3) / ref_bw
    result["decode_bandwidth_fraction_of_copy"] = kv_bytes / (dec_time * 1e-3) / copy_bw
    del batch, out

    # ---------------------------------------------------------------- prefill
    n = args.prefill_tokens
    batch = _paged_batch(device, [n], [n], hq, hkv, d, bs, dtype, gen)
    out = torch.empty_like(batch["query"])

    def prefill(cfg=None):
        return paged_attention_triton(**batch, scale=scale, out=out, config=cfg)

    t_pre = bench(prefill)
    k, v = _contiguous_kv(batch, n)
    q4 = batch["query"].transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, n, D]
    t_pre_sdpa, variant, ref = _time_sdpa(bench, q4, k, v, causal=True)
    err = (prefill().float() - ref[0].transpose(0, 1).float()).abs().max().item()
    del k, v, ref
    flops = 4 * hq * d * n * (n + 1) / 2  # causal QK^T and PV
    pre = {
        "tokens": n, "triton_ms": t_pre, "sdpa_ms": t_pre_sdpa, "sdpa_variant": variant,
        "triton_tflops": flops / (t_pre * 1e-3) / 1e12, "sdpa_tflops": flops / (t_pre_sdpa * 1e-3) / 1e12,
        "max_abs_err_vs_sdpa": err,
    }
    if args.sweep:
        cands = [AttentionConfig(block_m=m, tile=t, num_warps=w, num_stages=s)
                 for m in (64, 128) for t in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
        best, rows = _sweep(bench, prefill, cands)
        pre["sweep"] = rows
        if best:
            pre["best_config"], pre["best_ms"] = _cfg_dict(best[0]), best[1]
    pre_time = min(t_pre, pre.get("best_ms", t_pre))
    result["prefill"] = pre
    result["prefill_time_vs_sdpa"] = pre_time / t_pre_sdpa
    result["prefill_time_vs_sdpa_default_config"] = t_pre / t_pre_sdpa

    result["decode_time_ms"], result["decode_sdpa_time_ms"] = t_dec, t_dec_sdpa
    result["prefill_time_ms"], result["prefill_sdpa_time_ms"] = t_pre, t_pre_sdpa
    if args.sweep and args.write_config:
        result["written_config"] = _write_config(args, gpu_name, dec, pre)
    result["targets"] = {
        "decode_bandwidth_fraction>=": DECODE_TARGET, "decode_met": result["decode_bandwidth_fraction"] >= DECODE_TARGET,
        "prefill_time_vs_sdpa<=": PREFILL_TARGET, "prefill_met": result["prefill_time_vs_sdpa"] <= PREFILL_TARGET,
    }
    return result


def _write_config(args, gpu_name: str, dec: dict, pre: dict) -> str:
    """Merge the sweep's winners into the tuned-config file (kernels/tuned.py)."""
    from pathlib import Path

    import triton

    from kernels import tuned

    path = tuned.ATTENTION_FILE if args.write_config == "default" else Path(args.write_config)
    best = {}
    for kind, res in (("decode", dec), ("prefill", pre)):
        cfg = res.get("best_config")
        if cfg:
            # The heuristic's own split-KV choice stays in charge of num_segments.
            best[kind] = {f: cfg[f] for f in tuned.FIELDS}
    tuned.merge(gpu_name, args.dtype, max(16, triton.next_power_of_2(args.head_dim)), best, path)
    return str(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    print(json.dumps(run(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
