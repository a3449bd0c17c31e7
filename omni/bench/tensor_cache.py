"""`omni bench tensor-cache`: cost and benefit of the stage tensor cache.

On the `omni bench prefix` workload, with full hidden states delivered for
every request (as a stage with a downstream stage does):
- cache_overhead_fraction: share of step time spent writing rows into the
  tensor cache and gathering/concatenating them (target <= 3%);
- downstream_ttft_speedup: time until the full hidden states of a question
  are ready for the next stage, caching off / caching on;
- with the same questions sent together and decoded for a while:
  row_write_fraction: time spent storing each step's rows (side-stream copy
  wait + tensor-cache write; on a GPU on a background thread) / step time,
  row_write_blocking_fraction: the part of it on the step's own thread,
  deliver_ms_per_1k_rows: gathering a finished request's full sequence
  (cached + fresh rows, float32 numpy), per 1000 rows delivered,
  step_time_overhead_vs_no_rows: step time with rows over a text-only stage,
  minus 1 (all of the above, delivery of ~2,000-row sequences included).
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from omni.bench import engine_loop
from omni.bench.prefix import make_engine, qa_workload, run_one


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--num-questions", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens per question in the step-time A/B")


def run(args) -> dict:
    from omni.registry import resolve_model_path

    path = resolve_model_path(args.model)
    _, doc_ids, q_ids = qa_workload(path, args)
    _warm_up(args, doc_ids, q_ids)
    delivered, hidden, stats = {}, {}, {}
    for caching in (True, False):
        engine = make_engine(args.model, caching, emit_hidden_states=True, dtype=args.dtype)
        run_one(engine, "doc", doc_ids, 1)
        outs = [run_one(engine, f"q{i}", doc_ids + q, 1) for i, q in enumerate(q_ids)]
        for o in outs:
            assert o.hidden_states.shape[0] == len(o.prompt_token_ids)
        delivered[caching] = statistics.mean(o.metrics["e2e_s"] for o in outs)
        hidden[caching] = outs
        stats[caching] = engine.stats().as_dict()
        print(f"caching={caching}: full hidden states delivered in {delivered[caching] * 1000:.1f} ms "
              f"(mean over {len(outs)} questions)")
    max_diff = max(float(np.abs(a.hidden_states - b.hidden_states).max())
                   for a, b in zip(hidden[True], hidden[False]))
    s = stats[True]
    overhead = s["tensor_cache_time_s"] / s["step_time_s"]
    print(f"tensor cache: {s['tensor_cache_bytes'] / 2**20:.1f} MiB, rows served {s['tensor_cache_rows_served']}, "
          f"overhead {overhead * 100:.2f}% of step time, max |diff| on vs off {max_diff:.2e}")
    step_times = {}
    for rows in (True, False):
        engine = make_engine(args.model, True, emit_hidden_states=rows, dtype=args.dtype)
        run_one(engine, "doc", doc_ids, 1)
        batch_stats = _concurrent(engine, doc_ids, q_ids, args.decode_tokens)
        step_times[rows] = batch_stats["step_time_s"]
        if rows:
            st = batch_stats["step_time_s"]
            worker = batch_stats["tensor_cache_worker_time_s"] / st
            blocking = batch_stats["tensor_cache_time_s"] / st
            write = batch_stats["tensor_cache_write_time_s"] / st
            write_blocking = (batch_stats["tensor_cache_time_s"] - batch_stats["rows_deliver_time_s"]) / st
            deliver_ms_per_1k = 1e6 * batch_stats["rows_deliver_time_s"] / max(batch_stats["rows_delivered"], 1)
    ab = step_times[True] / step_times[False] - 1
    print(f"concurrent questions: step time with rows {step_times[True]:.3f}s vs text-only "
          f"{step_times[False]:.3f}s ({ab * 100:+.2f}%); per-step row writes {write * 100:.2f}% of step time "
          f"({write_blocking * 100:.2f}% on the step's thread); delivering full sequences "
          f"{deliver_ms_per_1k:.2f} ms per 1000 rows")
    return {
        "model": str(args.model),
        "dtype": args.dtype,
        "device": s.get("device"),
        "cache_overhead_fraction": overhead,
        "step_time_overhead_vs_no_rows": ab,
        "rows_blocking_fraction_concurrent": blocking,
        "rows_worker_fraction": worker,
        "row_write_fraction": write,
        "row_write_blocking_fraction": write_blocking,
        "deliver_ms_per_1k_rows": deliver_ms_per_1k,
        "downstream_ttft_speedup": delivered[False] / delivered[True],
        "delivered_cached_ms": delivered[True] * 1000,
        "delivered_uncached_ms": delivered[False] * 1000,
        "rows_served": s["tensor_cache_rows_served"],
        "tensor_cache_bytes": s["tensor_cache_bytes"],
        "max_abs_diff_on_vs_off": max_diff,
    }


def _concurrent(engine, doc_ids, q_ids, max_tokens: int) -> dict:
    """All questions at once, each decoding `max_tokens`; the engine's stats afterwards."""
    from omni.messages import StageInput
    from omni.sampling_params import SamplingParams

    before = engine.stats().as_dict()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine_loop.run(engine, [StageInput(f"c{i}", prompt_token_ids=doc_ids + q, sampling_params=sp)
                             for i, q in enumerate(q_ids)])
    after = engine.stats().as_dict()
    keys = ("step_time_s", "tensor_cache_time_s", "tensor_cache_worker_time_s", "tensor_cache_write_time_s",
            "rows_deliver_time_s", "rows_delivered")
    return {k: after[k] - before[k] for k in keys}


def _warm_up(args, doc_ids, q_ids) -> None:
    """Run every step shape once (document prefill, a cached question, batched decode)
    so that one-time costs (on a GPU: Triton compiling each kernel configuration,
    cuBLAS handles) stay out of every timed number."""
    engine = make_engine(args.model, True, emit_hidden_states=True, dtype=args.dtype)
    run_one(engine, "doc", doc_ids, 1)
    run_one(engine, "q", doc_ids + q_ids[0], 1)
    _concurrent(engine, doc_ids, q_ids[:4], 4)
    engine.close()
