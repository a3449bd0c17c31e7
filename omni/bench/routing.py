"""`omni bench routing`: stage replicas routed by prefix affinity vs round robin vs one replica, one run.

The SmolLM2 chain (thinker -> talker fed the thinker's hidden states) on the Ray backend, three setups
over the same conversations: every stage with --replicas replicas routed by prefix_affinity, the same
replicas routed round robin, and one replica per stage. --conversations clients run side by side
(starts staggered, so that their turns interleave); each has --turns turns: the first is a long system
prompt shared by every conversation + the conversation's own context + a question, each later one
resends the conversation so far (the thinker's replies included) + a new question. Prompts are token
ids (seeded), so each turn extends the previous one exactly. Every stage's KV cache is sized so that
one replica holds the whole workload: the comparison is about where requests land, not cache size.

Measured per setup, over the workload only (the stats before and after it; a short warm-up of every
replica comes first): the prefix-cache hit rate over all stages (cached prompt tokens / prompt tokens),
per stage, and each turn's TTFT: from submission to the thinker's first token, as the client sees it.

    hit_rate_affinity, hit_rate_round_robin, hit_rate_single
    affinity_vs_single_hit_rate      affinity / single (target >= 0.95: routing keeps what one cache gives)
    ttft_round_robin_over_affinity   mean TTFT of turns 2+, round robin / affinity (target >= 1.5)
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from omni.bench.workloads import Conversation, random_ids, stream_timed

ROOT = Path(__file__).resolve().parents[2]
SETUPS = ("affinity", "round_robin", "single")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="stage_configs/smollm2_chain.yaml")
    p.add_argument("--backend", default="ray", choices=["ray", "local"])
    p.add_argument("--replicas", type=int, default=2, help="replicas per stage (affinity and round robin)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512, help="the system prompt every conversation shares")
    p.add_argument("--context-tokens", type=int, default=384, help="each conversation's own context")
    p.add_argument("--turn-tokens", type=int, default=32, help="the question of each turn")
    p.add_argument("--reply-tokens", type=int, default=32, help="thinker tokens per turn (ignore_eos)")
    p.add_argument("--talker-tokens", type=int, default=8)
    p.add_argument("--stagger-s", type=float, default=0.5, help="delay between the clients' starts")
    p.add_argument("--memory-budget-mb", type=float, default=768, help="KV cache of every replica")
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--seed", type=int, default=0)


def _workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's first prompt, and its questions for turns 2+."""
    rng = random.Random(args.seed)
    system = random_ids(rng, args.system_tokens)
    first = [system + random_ids(rng, args.context_tokens) + random_ids(rng, args.turn_tokens)
             for _ in range(args.conversations)]
    questions = [[random_ids(rng, args.turn_tokens) for _ in range(args.turns - 1)] for _ in range(args.conversations)]
    return first, questions


def _overrides(args: argparse.Namespace, stages: list[str], setup: str) -> dict[str, Any]:
    replicas = 1 if setup == "single" else args.replicas
    routing = "round_robin" if setup == "round_robin" else "prefix_affinity"
    return {s: {"replicas": replicas, "routing": routing, "enable_prefix_caching": True,
                "cache": {"memory_budget_mb": args.memory_budget_mb, "num_blocks": None}} for s in stages}


def _cache_counts(stats: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {n: (s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)) for n, s in stats["stages"].items()}


def _client(omni: Any, c: int, setup: str, prompt: list[int], questions: list[list[int]], sampling: Any,
            entry: str, delay: float, out: list[dict[str, Any]]) -> None:
    time.sleep(delay)
    conv = Conversation(ids=prompt)
    for turn, prompt in conv.turns([[], *questions]):
        [r] = stream_timed(omni, [{"prompt_token_ids": prompt, "request_id": f"{setup}-c{c}-t{turn}"}], sampling)
        first, outputs, error = r.first_token_s.get(entry), r.outputs, r.error
        if error or entry not in outputs or first is None:
            raise RuntimeError(f"{setup}: conversation {c} turn {turn + 1} failed: {error or 'no output'}")
        out.append({"conversation": c, "turn": turn + 1, "ttft_s": first, "e2e_s": max(r.output_s.values()),
                    "prompt_tokens": len(prompt),
                    "cached": {s: o.num_cached_tokens for s, o in outputs.items()},
                    "engine_ttft_s": {s: o.metrics.get("ttft_s") for s, o in outputs.items()},
                    "tokens": {s: list(o.token_ids) for s, o in outputs.items()}})
        conv.answer(outputs[entry].token_ids)


def run_setup(args: argparse.Namespace, cfg: Any, setup: str) -> dict[str, Any]:
    from omni import Omni

    stages = [s.name for s in cfg.stages]
    entry = stages[0]
    sampling = {entry: {"temperature": 0.0, "max_tokens": args.reply_tokens, "ignore_eos": True}}
    for s in stages[1:]:
        sampling[s] = {"temperature": 0.0, "max_tokens": args.talker_tokens}
    first, questions = _workload(args)
    t_start = time.perf_counter()
    with Omni(cfg, stage_overrides=_overrides(args, stages, setup), backend=args.backend) as o:
        up_s = time.perf_counter() - t_start
        rng = random.Random(-1)  # warm-up: every replica runs a request unrelated to the workload
        warm = [{"prompt_token_ids": random_ids(rng, 64)} for _ in range(1 if setup == "single" else args.replicas)]
        for w in o.generate(warm, {s: {"max_tokens": 2} for s in stages}, use_tqdm=False):
            if w.error:
                raise RuntimeError(f"{setup}: warm-up failed: {w.error}")
        before = _cache_counts(o.stats())
        load_before = os.getloadavg()[0]
        records: list[dict[str, Any]] = []
        errors: list[BaseException] = []

        def client(c: int) -> None:
            try:
                _client(o, c, setup, first[c], questions[c], sampling, entry, c * args.stagger_s, records)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.conversations)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise errors[0]
        stats = o.stats()
        after = _cache_counts(stats)
    per_stage = {}
    for s in stages:
        q, h = after[s][0] - before[s][0], after[s][1] - before[s][1]
        per_stage[s] = {"hit_rate": h / q if q else 0.0, "prompt_tokens": q, "cached_tokens": h}
    q_all = sum(v["prompt_tokens"] for v in per_stage.values())
    h_all = sum(v["cached_tokens"] for v in per_stage.values())
    later = [r["ttft_s"] for r in records if r["turn"] > 1]
    turn1 = [r["ttft_s"] for r in records if r["turn"] == 1]
    res = {
        "setup": setup, "replicas": 1 if setup == "single" else args.replicas,
        "hit_rate": h_all / q_all if q_all else 0.0, "per_stage": per_stage,
        "ttft_turn1_ms": statistics.mean(turn1) * 1000, "ttft_turns2plus_ms": statistics.mean(later) * 1000,
        "ttft_turns2plus_median_ms": statistics.median(later) * 1000,
        "engine_ttft_turns2plus_ms": {s: statistics.mean(r["engine_ttft_s"][s] for r in records if r["turn"] > 1)
                                      * 1000 for s in stages},
        "e2e_mean_ms": statistics.mean(r["e2e_s"] for r in records) * 1000,
        "wall_s": wall, "startup_s": up_s, "load_avg_1m": [load_before, os.getloadavg()[0]],
        "routers": {s: stats["stages"][s].get("router") for s in stages if "router" in stats["stages"][s]},
        "replica_nodes": {s: [r.get("node_id") for r in stats["stages"][s].get("replicas", [])] for s in stages},
        "records": sorted(records, key=lambda r: (r["conversation"], r["turn"])),
    }
    by_stage = ", ".join(f"{s} {v['hit_rate']:.3f}" for s, v in per_stage.items())
    print(f"  {setup:>11}: hit rate {res['hit_rate']:.3f} ({by_stage}); "
          f"TTFT turn 1 {res['ttft_turn1_ms']:.0f} ms, turns 2+ {res['ttft_turns2plus_ms']:.0f} ms; "
          f"wall {wall:.1f}s; load {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    from omni.config.loader import load_config

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the embedded Ray needs no token auth
    for name in ("replicas", "conversations", "system_tokens", "context_tokens", "turn_tokens", "reply_tokens",
                 "talker_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")
    if args.turns < 2:
        raise SystemExit("error: --turns must be >= 2 (TTFT is compared over turns 2+)")
    path = Path(args.config)
    if not path.exists() and (ROOT / path).exists():
        path = ROOT / path
    cfg = load_config(path)
    print(f"routing: {args.conversations} conversations x {args.turns} turns ({args.system_tokens} shared + "
          f"{args.context_tokens} own + {args.turn_tokens}-token questions, {args.reply_tokens}-token replies), "
          f"{args.replicas} replicas per stage, {args.backend} backend; cpus {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.2f}")
    results = {setup: run_setup(args, cfg, setup) for setup in args.setups}
    out: dict[str, Any] = {"bench": "routing", "config": str(path), "cpu_count": os.cpu_count(),
                           "conversations": args.conversations, "turns": args.turns, "replicas": args.replicas}
    for setup, res in results.items():
        out[f"hit_rate_{setup}"] = res["hit_rate"]
    if {"affinity", "single"} <= set(results):
        out["affinity_vs_single_hit_rate"] = results["affinity"]["hit_rate"] / max(results["single"]["hit_rate"], 1e-9)
    if {"affinity", "round_robin"} <= set(results):
        out["ttft_round_robin_over_affinity"] = (results["round_robin"]["ttft_turns2plus_ms"]
                                                 / results["affinity"]["ttft_turns2plus_ms"])
    tokens = {s: [r["tokens"] for r in res["records"]] for s, res in results.items()}
    out["outputs_identical"] = len({repr(t) for t in tokens.values()}) == 1
    out["load_avg_1m"] = {s: res["load_avg_1m"] for s, res in results.items()}
    out["setups"] = {s: {k: v for k, v in res.items() if k != "records"} for s, res in results.items()}
    for key, target in (("affinity_vs_single_hit_rate", 0.95), ("ttft_round_robin_over_affinity", 1.5)):
        if key in out:
            print(f"  {key}: {out[key]:.3f} (target >= {target})")
    return out
