"""`omni bench tensor-cache`: cost and benefit of the stage tensor cache.

On the `omni bench prefix` workload, with full hidden states delivered for
every request (as a stage with a downstream stage does):
- cache_overhead_fraction: share of step time spent writing rows into the
  tensor cache and gathering/concatenating them (target <= 3%);
- downstream_ttft_speedup: time until the full hidden states of a question
  are ready for the next stage, caching off / caching on.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from .prefix import make_engine, qa_workload, run_one


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--num-questions", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def run(args) -> dict:
    from omni.registry import resolve_model_path

    path = resolve_model_path(args.model)
    _, doc_ids, q_ids = qa_workload(path, args)
    delivered, hidden, stats = {}, {}, {}
    for caching in (True, False):
        engine = make_engine(path, caching, emit_hidden_states=True)
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
    return {
        "model": str(args.model),
        "cache_overhead_fraction": overhead,
        "downstream_ttft_speedup": delivered[False] / delivered[True],
        "delivered_cached_ms": delivered[True] * 1000,
        "delivered_uncached_ms": delivered[False] * 1000,
        "rows_served": s["tensor_cache_rows_served"],
        "tensor_cache_bytes": s["tensor_cache_bytes"],
        "max_abs_diff_on_vs_off": max_diff,
    }
