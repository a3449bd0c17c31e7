"""`omni bench head`: a decode step's output-head product, torch's `linear` vs the CPU-prepared head.

The logits of a decode step are the sampled rows (one per running request) times the output head's
[vocab, hidden] weight; on a CPU that product is bound by reading the weight, and how fast MKL reads it
depends on the layout and the operand order (omni/engine/runner/output_head.py). For each head shape (default:
the small Qwen2.5-Omni / Qwen3-Omni thinkers' 151,936 x 256 and SmolLM2's 49,152 x 576) and each row count
(default 1, 2, 4, 8, 16), side by side in one run, alternating: the median time of `F.linear(x, W)` with W
row-major (what transformers runs), with W stored column-major (every row count's product before the
dispatch: `column_ms`) and of the same head after `prepare_cpu_head`, on --threads threads
(default 1: a stage's share of this 2-core machine). The weights are random: the time of a product does
not depend on the values. Also checked: both give the same argmax per row.

JSON keys: heads {"VxH": {"rows": {"N": {"linear_ms", "column_ms", "prepared_ms", "speedup" (linear /
prepared), "speedup_vs_column"}}, "layout": "dual" | "column"}}, speedup_mean (over every shape and row
count), threads.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", default=["151936x256", "49152x576"], help="VOCABxHIDDEN each")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="rows per product")
    p.add_argument("--repeats", type=int, default=15, help="products timed per side (the median is reported)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)


def _shape(text: str) -> tuple[int, int]:
    try:
        vocab, hidden = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not VOCABxHIDDEN (e.g. 151936x256)") from None
    return vocab, hidden


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from omni.engine.runner.output_head import prepare_cpu_head

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    heads: dict[str, Any] = {}
    speedups = []
    with torch.inference_mode():
        for text in args.shapes:
            vocab, hidden = _shape(text)
            plain = torch.empty(vocab, hidden).normal_(generator=gen)
            head = torch.nn.Linear(hidden, vocab, bias=False)
            head.weight.data = plain.clone()
            layout = prepare_cpu_head(head, torch.device("cpu"))
            column = plain.t().contiguous().t()
            rows_out = {}
            for n in args.rows:
                x = torch.empty(n, hidden).normal_(generator=gen)
                if not torch.equal(head(x).argmax(-1), F.linear(x, plain).argmax(-1)):
                    raise RuntimeError(f"head {text}, {n} rows: the prepared head's argmax differs from linear's")
                times: dict[str, list[float]] = {"linear": [], "column": [], "prepared": []}
                for _ in range(args.repeats):  # alternating: a change of machine load hits all alike
                    for side, fn in (("linear", lambda: F.linear(x, plain)), ("column", lambda: F.linear(x, column)),
                                     ("prepared", lambda: head(x))):
                        t0 = time.perf_counter()
                        fn()
                        times[side].append(time.perf_counter() - t0)
                lin, col, prep = (statistics.median(times[s]) * 1e3 for s in ("linear", "column", "prepared"))
                rows_out[str(n)] = {"linear_ms": lin, "column_ms": col, "prepared_ms": prep, "speedup": lin / prep,
                                    "speedup_vs_column": col / prep}
                speedups.append(lin / prep)
                print(f"head {text} ({layout}), {n} rows: linear {lin:.2f} ms, column-major {col:.2f} ms, "
                      f"prepared {prep:.2f} ms ({lin / prep:.2f}x linear, {col / prep:.2f}x column-major)", flush=True)
            heads[text] = {"layout": layout, "rows": rows_out}
    return {"heads": heads, "speedup_mean": statistics.mean(speedups), "threads": args.threads}
