"""`omni bench throughput`: omni vs transformers on the same requests.

SmolLM2-135M, 32 requests with prompt lengths 32-512 and max_tokens 16-128
(ignore_eos: every request generates exactly what it asked for). Output
tokens/s for omni's engine, transformers' `generate` on one padded batch, and
transformers' continuous batching (`generate_batch` manager), same dtype.

And how close omni's forward passes come to the machine (flops.py): their achieved GFLOP/s (the
model's FLOPs over the engine's forward time, step_profile.py) against this machine's own GEMM rate
on the model's shapes and threads, measured in the same run: `mfu_vs_sgemm` (target >= 0.7 on a CPU).
"""
from __future__ import annotations

import argparse
import resource

import torch

from omni.bench import engine_loop
from omni.bench.references import causal_lm as hf
from omni.bench.workloads import Timer, throughput_requests


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2", help="model path or builtin:NAME")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--skip-hf", action="store_true", help="time omni only")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where omni and transformers both run (auto: cuda when available)")


def _omni(model, reqs, dtype, device, cuda_graphs: bool = True) -> tuple[float, int, dict, dict]:
    """Time omni's engine (the causal_lm stage of `model`) on `reqs`: (seconds, tokens produced, engine
    counters, the work its forward passes did: computed spans, sampled rows, steps, forward / sampling seconds)."""
    from omni.messages import StageInput
    from omni.sampling_params import SamplingParams

    engine = engine_loop.engine("bench", "causal_lm", model, dtype=dtype, device=device, enable_prefix_caching=True,
                                emit_hidden_states=False, cuda_graphs=cuda_graphs,
                                scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 2048})
    # Warm-up: every step shape once (a long prefill, a short mixed step, batched
    # decode) so that one-time costs (Triton compiling each kernel configuration
    # on a GPU) stay out of the timing.
    engine_loop.run(engine, [StageInput(f"warm{i}", prompt_token_ids=[100 + i] * n,
                                        sampling_params=SamplingParams(max_tokens=3))
                             for i, n in enumerate((300, 8, 8))])
    produced = 0
    before = engine.stats().as_dict()
    spans = []
    steps = []  # (rows, sampled rows) of each forward pass: the GEMM reference is timed at these sizes
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with Timer() as t:
        for step, _ in engine_loop.steps(engine, [StageInput(
                str(i), prompt_token_ids=r.prompt_token_ids, sampling_params=SamplingParams(
                    temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)) for i, r in enumerate(reqs)]):
            if step.forward_rows:
                steps.append((step.forward_rows, step.sampled_rows))
            for out in step.finished:
                produced += len(out.token_ids)
                # computed: past the prefix hit, up to the last token fed (the final sampled one is not)
                spans.append((out.num_cached_tokens, len(out.prompt_token_ids) + len(out.token_ids) - 1))
    # Page faults while the steps ran: a step that touches fresh pages pays for each (host_allocator.py).
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    stats = engine.stats().as_dict()
    engine.close()
    work = {"spans": spans, "sampled_rows": produced, "step_sizes": steps, "minor_page_faults": faults,
            **{k: stats[k] - before[k] for k in ("steps", "forward_time_s", "sampling_time_s")}}
    return t.elapsed, produced, {k: stats[k] for k in ("steps", "step_time_s", "cuda_graph_replays")}, work


def _mfu(hf_model, work: dict, device: str) -> dict:
    """Achieved GFLOP/s of the forward passes vs this machine's GEMM rate on the model's shapes (flops.py),
    timed on `hf_model`'s weights (the same checkpoint, dtype and device as omni's stage)."""
    from omni.bench.flops import decoder_shape, forward_flops, gemm_gflops

    shape = decoder_shape(hf_model)
    flops = forward_flops(shape, work["spans"], work["sampled_rows"])
    # On a GPU kernels run asynchronously: the step waits for them in the sampler's copy of the tokens.
    seconds = work["forward_time_s"] + (work["sampling_time_s"] if device == "cuda" else 0.0)
    gemm = gemm_gflops(shape, flops, work["step_sizes"])
    achieved = sum(flops) / seconds / 1e9
    rows = [r for r, _ in work["step_sizes"]]
    return {"forward_gflop": sum(flops) / 1e9, "forward_s": seconds, "forward_gflops_per_s": achieved,
            "sgemm_gflops_per_s": gemm["sgemm"], "best_gemm_gflops_per_s": gemm["best"], "steps": len(rows),
            "rows_per_step_mean": sum(rows) / max(1, len(rows)),
            "threads": torch.get_num_threads(), "minor_page_faults": work["minor_page_faults"],
            "mfu_vs_sgemm": achieved / gemm["sgemm"], "mfu_vs_best_gemm": achieved / gemm["best"]}


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from omni.engine.runner.host_allocator import tune_host_allocator
    from omni.registry import resolve_model_path

    path = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    reqs = throughput_requests(args.num_requests, model.config.vocab_size, args.seed)
    expected = sum(r.max_tokens for r in reqs)
    print(f"{len(reqs)} requests, {sum(len(r.prompt_token_ids) for r in reqs)} prompt tokens, "
          f"{expected} output tokens, threads={torch.get_num_threads()}")
    t_omni, n_omni, omni_stats, work = _omni(args.model, reqs, args.dtype, device)
    assert n_omni == expected, (n_omni, expected)
    mfu = _mfu(model, work, device)
    print(f"omni forward passes: {mfu['forward_gflops_per_s']:.1f} GFLOP/s; this machine's GEMM on the model's "
          f"shapes ({mfu['steps']} steps, {mfu['rows_per_step_mean']:.0f} rows each on average, "
          f"{mfu['threads']} threads): {mfu['sgemm_gflops_per_s']:.1f} GFLOP/s (sgemm), "
          f"{mfu['best_gemm_gflops_per_s']:.1f} GFLOP/s (the faster of "
          f"sgemm and oneDNN's packed product); mfu_vs_sgemm {mfu['mfu_vs_sgemm']:.2f}, "
          f"mfu_vs_best_gemm {mfu['mfu_vs_best_gemm']:.2f}")
    result = {"omni_engine": omni_stats,"model": str(args.model), "device": device, "dtype": args.dtype,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
              "num_requests": len(reqs), "output_tokens": expected,
              "omni_s": t_omni, "omni_tokens_per_s": n_omni / t_omni, "mfu": mfu,
              "mfu_vs_sgemm": mfu["mfu_vs_sgemm"], "mfu_vs_best_gemm": mfu["mfu_vs_best_gemm"],
              "host_allocator": tune_host_allocator()}
    print(f"omni: {t_omni:.2f}s, {n_omni / t_omni:.1f} tok/s ({omni_stats})")
    if device == "cuda":
        # The same engine without CUDA graphs: what graph replay buys on this machine.
        t_eager, n_eager, eager_stats, _ = _omni(args.model, reqs, args.dtype, device, cuda_graphs=False)
        result.update(omni_eager_tokens_per_s=n_eager / t_eager, cuda_graph_speedup=t_eager / t_omni)
        print(f"omni without CUDA graphs: {t_eager:.2f}s, {n_eager / t_eager:.1f} tok/s ({eager_stats})")
    if not args.skip_hf:
        t_gen, n_gen = hf.generate(model, reqs, device)
        print(f"hf generate (padded): {t_gen:.2f}s, {n_gen / t_gen:.1f} tok/s")
        try:
            model_cb = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                            attn_implementation="sdpa").to(device).eval()
            t_cb, n_cb = hf.generate_batch(model_cb, reqs)
            cb_tps = n_cb / t_cb
            print(f"hf generate_batch: {t_cb:.2f}s, {cb_tps:.1f} tok/s")
        except Exception as exc:  # report, do not hide: the key is then null
            print(f"hf generate_batch failed: {type(exc).__name__}: {exc}")
            cb_tps = None
        best = max(x for x in (n_gen / t_gen, cb_tps) if x is not None)
        result.update(hf_generate_tokens_per_s=n_gen / t_gen, hf_generate_batch_tokens_per_s=cb_tps,
                      speedup_vs_best_hf=result["omni_tokens_per_s"] / best)
    return result
