"""`omni bench plan`: prefix-cache hit rate with the planner's split of one budget vs an even split.

One fixed budget for the whole pipeline (default: exactly what the planner asks for the declared
workload: the stages' fixed needs plus the blocks to keep every conversation cached). The same budget
is then split two ways over the autoregressive stages' KV caches:

    planned   `omni plan`'s split: each prefix-cached stage gets the blocks its own sequence needs (the
              talker's sequence is the thinker's plus its codec tokens, and its blocks cost more)
    even      the bytes left after the fixed needs, halved (one share per stage), each share in blocks

and a multi-turn workload is replayed through each stage's real KV cache manager
(omni/engine/core/kv_cache: the scheduler's own path, Request -> get_computed_blocks -> allocate_slots ->
free) with that many blocks: N conversations interleaved, batches of up to max_num_seqs turns; a
turn's thinker sequence is the conversation so far + the user's message + its reply (sampling.max_tokens);
the talker's is that sequence + its own codec tokens. No model runs: the hit rate is the caches'
(what they can hold decides it), so this runs in seconds at the issue's sizes. Reported: each stage's
hit rate (hit prompt tokens / prompt tokens) per split, the pipeline's (all stages' tokens together),
`planned_over_even_hit_rate`, and the planning time (`planning_seconds`: the arithmetic plan, as
`omni run` makes it at start-up).
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Any

from omni.config.loader import load_config
from omni.engine.core.kv_cache import KVCacheManager
from omni.engine.core.request import Request
from omni.pipeline.graph import StageGraph

GiB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="stage_configs/qwen2_5_omni_small.yaml", help="the pipeline")
    parser.add_argument("--conversations", type=int, default=16, help="concurrent conversations (>= 1)")
    parser.add_argument("--context-tokens", type=int, default=1024,
                        help="tokens of a conversation's context after its last turn (entry stage's tokens)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (>= 1)")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="the budget (default: what the planner asks for the workload)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")


def _plan(config: Any, budget_gb: float | None, args: argparse.Namespace) -> tuple[Any, Any, float]:
    """(the config with the workload declared and every stage 'auto', its plan, seconds the plan took)."""
    from omni.planning.plan import plan_memory

    raw = config.model_dump()
    raw["runtime"]["plan"] = {"concurrent_conversations": args.conversations, "context_tokens": args.context_tokens}
    raw["runtime"]["memory"] = {"budget_gb": budget_gb} if budget_gb else None
    for s in raw["stages"]:
        s["cache"]["num_blocks"] = None
        s["cache"]["memory_budget_mb"] = "auto"
    cfg = load_config(raw)
    t0 = time.perf_counter()
    plan = plan_memory(cfg, memory_gb=budget_gb)
    return cfg, plan, time.perf_counter() - t0


def _conversations(config: Any, graph: StageGraph, args: argparse.Namespace) -> list[list[dict[str, list[int]]]]:
    """Per conversation, per turn: each AR stage's (prompt, full sequence) token lists."""
    rng = random.Random(args.seed)
    entry = graph.order[0]
    reply = config.stage(entry).sampling.max_tokens or 16
    user = max(1, (args.context_tokens - args.turns * reply) // args.turns)
    out = []
    for _ in range(args.conversations):
        history: list[int] = []
        turns = []
        for _ in range(args.turns):
            seqs: dict[str, tuple[list[int], list[int]]] = {}
            prompt = history + [rng.randrange(100_000) for _ in range(user)]
            full = prompt + [rng.randrange(100_000) for _ in range(reply)]
            seqs[entry] = (prompt, full)
            for n in graph.order[1:]:
                ups = graph.upstream[n]
                base = max((seqs[u][1] for u in ups if u in seqs), key=len, default=full)
                own = config.stage(n).sampling.max_tokens or 0
                seqs[n] = (list(base), base + [rng.randrange(8000) for _ in range(own)])
            history = full
            turns.append(seqs)
        out.append(turns)
    return out


def _replay(blocks: dict[str, int], config: Any, convs: list, batch: int) -> dict[str, dict[str, float]]:
    """Hit prompt tokens / prompt tokens per stage, replaying `convs` through managers of `blocks` blocks."""
    result = {}
    for name, nb in blocks.items():
        s = config.stage(name)
        kv = KVCacheManager(nb, s.cache.block_size, True, s.cache.hash_seed)
        hits = prompts = refused = 0
        schedule = [(c, t) for t in range(len(convs[0])) for c in range(len(convs))]  # interleaved turns
        for i in range(0, len(schedule), batch):
            live = []
            for c, t in schedule[i:i + batch]:
                prompt, full = convs[c][t][name]
                req = Request(f"{c}-{t}", full, block_hasher=kv.block_hasher)
                cached, n = kv.get_computed_blocks(req)
                n = min(n, len(prompt))
                prompts += len(prompt)
                if kv.allocate_slots(req, req.num_tokens - n, n, cached) is None:
                    refused += 1  # no room for this turn beside the batch: it hits nothing
                    continue
                hits += n
                live.append(req)
            for req in live:
                kv.free(req)
        result[name] = {"num_blocks": nb, "hit_rate": hits / max(prompts, 1), "hit_tokens": hits,
                        "prompt_tokens": prompts, "turns_without_room": refused}
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.conversations < 1 or args.turns < 1 or args.context_tokens < 1:
        raise ValueError("--conversations, --turns and --context-tokens must be >= 1")
    base = load_config(args.config)
    budget_gb = args.memory_gb
    if budget_gb is None:  # the budget the workload needs: fixed needs + every stage's wanted blocks
        _, sizing, _ = _plan(base, None, args)
        need = sum(len(p.devices) * (p.needs.fixed + max(p.wanted_blocks, p.needs.min_blocks) * p.needs.device_per_block())
                   for p in sizing.stages.values())
        budget_gb = need / GiB
    cfg, plan, planning_s = _plan(base, budget_gb, args)
    plan.raise_if_refused()
    ar = {n: p for n, p in plan.stages.items() if p.needs.autoregressive and p.needs.prefix_caching}
    fixed = sum(len(p.devices) * p.needs.fixed for p in plan.stages.values())
    share = (int(budget_gb * GiB) - fixed) / len(ar)
    even = {n: int(share // p.needs.device_per_block()) for n, p in ar.items()}
    planned = {n: p.num_blocks for n, p in ar.items()}
    graph = StageGraph.of(cfg)
    convs = _conversations(cfg, graph, args)
    batch = min(cfg.stage(graph.order[0]).scheduler.max_num_seqs, args.conversations)
    res_p = _replay(planned, cfg, convs, batch)
    res_e = _replay(even, cfg, convs, batch)

    def total(res: dict) -> float:
        return sum(r["hit_tokens"] for r in res.values()) / max(sum(r["prompt_tokens"] for r in res.values()), 1)

    hp, he = total(res_p), total(res_e)
    for name in ar:
        print(f"{name}: planned {planned[name]} blocks, hit rate {res_p[name]['hit_rate']:.3f}; "
              f"even {even[name]} blocks, hit rate {res_e[name]['hit_rate']:.3f}")
    print(f"pipeline hit rate: planned {hp:.3f}, even {he:.3f}; planning {planning_s * 1000:.1f} ms")
    return {
        "config": args.config, "budget_gb": round(budget_gb, 4), "conversations": args.conversations,
        "context_tokens": args.context_tokens, "turns": args.turns,
        "planned": res_p, "even": res_e, "planned_hit_rate": hp, "even_hit_rate": he,
        "planned_over_even_hit_rate": hp / he if he else float("inf"),
        "planning_seconds": planning_s,
    }
