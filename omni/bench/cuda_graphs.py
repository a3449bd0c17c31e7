"""`omni bench cuda-graphs`: a stage's decode step with CUDA graphs vs eager, same requests, one run.

On a GPU a small decode step is bound by the host: hundreds of kernel launches from Python, each costing more
than the kernel. A captured CUDA graph replays them with one launch (omni/engine/runner/cuda_graphs.py). This bench
builds the stage twice through the engine factory (CUDA graphs on and off, each with its own copy of the model)
and runs the same requests through both, `--batch` requests at a time: a `--prompt-tokens` prefill, then
`--decode-steps` greedy steps (min_tokens = max_tokens: every run does the same work). Per batch size: the median decode step in ms of each,
`speedup` (eager / graphs) and `tokens_identical` (greedy tokens of the two equal). `graph_replays` says how many
steps replayed a graph (0: the model does not opt in, or capture failed: see the log).

The default model is Qwen2.5-Omni-7B's thinker at its real shapes with random weights made on the GPU
(`builtin:qwen2_5-omni-7b-shapes`); `--stage-model` / `--model` take any registered autoregressive stage.
Without CUDA it answers with `skipped` (`--device cpu` runs it anyway, both sides eager: a smoke run).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from omni.bench import engine_loop


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage-model", default="qwen2_5_omni_thinker", help="registered stage model name")
    p.add_argument("--model", default="builtin:qwen2_5-omni-7b-shapes", help="model path or builtin:NAME")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run, both sides eager")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="requests decoded together")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks of 16 tokens, per engine")


def _engine(args, graphs: bool) -> Any:
    """The stage with CUDA graphs (`graphs`) or without (eager), as engine_factory builds it."""
    seqs = max(args.batch)
    return engine_loop.engine(
        args.stage_model, args.stage_model, args.model, enable_prefix_caching=False, device=args.device,
        dtype=args.dtype, cuda_graphs=graphs, emit_hidden_states=False,
        cache={"block_size": 16, "num_blocks": args.num_blocks},
        scheduler={"max_num_seqs": seqs, "max_num_batched_tokens": max(seqs * args.prompt_tokens, 512)})


def _run(engine: Any, tag: str, args, batch: int) -> tuple[float, list[list[int]]]:
    """(median decode step in ms, each request's tokens)."""
    import torch

    from omni.messages import StageInput
    from omni.sampling_params import SamplingParams

    n = args.decode_steps
    sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    inputs = [StageInput(f"{tag}{i}", sampling_params=sp,
                         prompt_token_ids=[(37 * j + 11 * i) % 30000 + 100 for j in range(args.prompt_tokens)])
              for i in range(batch)]
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    times, outs = [], {}
    for k, (step, seconds) in enumerate(engine_loop.steps(engine, inputs, sync=sync)):
        if k:  # the first step is the prefill
            times.append(seconds)
        for o in step.finished:
            outs[o.request_id] = list(o.token_ids)
    return statistics.median(times) * 1000, [outs[f"{tag}{i}"] for i in range(batch)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        return {"bench": "cuda-graphs", "gpu": None, "skipped": "no CUDA device: CUDA graphs need a GPU "
                "(--device cpu: a smoke run, both sides eager)"}
    t0 = time.perf_counter()
    graphed = _engine(args, True)
    load_s = time.perf_counter() - t0  # the graphed engine's: its model loaded, its graphs captured
    eager = _engine(args, False)
    for engine, tag in ((graphed, "warm-g"), (eager, "warm-e")):  # Triton compiles, first allocations
        _run(engine, tag, argparse.Namespace(**{**vars(args), "prompt_tokens": 16, "decode_steps": 4}), 1)
    levels = {}
    for batch in args.batch:
        g_ms, g_tokens = _run(graphed, f"g{batch}-", args, batch)
        e_ms, e_tokens = _run(eager, f"e{batch}-", args, batch)
        levels[str(batch)] = {"graphs_ms": g_ms, "eager_ms": e_ms, "speedup": e_ms / g_ms,
                              "tokens_identical": int(g_tokens == e_tokens)}
    stats = graphed.stats().as_dict()
    return {
        "bench": "cuda-graphs", "stage_model": args.stage_model, "model": args.model, "dtype": args.dtype,
        "device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__, "prompt_tokens": args.prompt_tokens, "decode_steps": args.decode_steps,
        "load_and_capture_s": load_s, "graph_sizes": stats.get("cuda_graph_sizes", []),
        "graph_replays": stats.get("cuda_graph_replays", 0), "batches": levels,
        "speedup_min": min(v["speedup"] for v in levels.values()),
        "tokens_identical": int(all(v["tokens_identical"] for v in levels.values())),
    }
