"""`omni bench pipeline`: the pipeline runtime, local vs Ray backend, and per-stage prefix caching.

1. Backend overhead: the same workload (several concurrent requests with random prompts) on the local
   backend (every stage in this process) and on the Ray backend (one actor per stage), after a warm-up
   request on each. Repeats alternate between the backends (machine noise hits both alike), each repeat
   with fresh prompts (no prefix hits across repeats). `ray_over_local_time_ratio` = median Ray time /
   median local time (target <= 1.15).
   Threads: a Ray actor runs torch with OMP_NUM_THREADS = its num_cpus; the local backend with this
   process's torch threads. For a like-for-like comparison every stage's forward pass gets the same number
   of threads on both backends: --threads-per-stage N (default max(1, cores // stages), so that the Ray
   actors together use the machine's cores) sets torch's threads in this process and num_cpus = N on every
   stage actor. The JSON reports the threads measured in this process and inside each actor.
   (On a shared machine, torch with as many threads as cores collapses as soon as another process takes a
   core: every parallel region waits for a descheduled thread.)
2. Per-stage TTFT with prefix caching on vs off: multi-turn conversations (each turn resends the
   conversation so far, replies included, plus new tokens); per stage, mean TTFT of turns 2+ with caching
   off / on (`per_stage_ttft_speedup`). TTFT is the engine's, per stage: from the request's arrival at
   that stage to its first token.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from omni.bench.workloads import Conversation, random_ids
from omni.pipeline.step_timers import overhead_ms

ROOT = Path(__file__).resolve().parents[2]
TARGET_RATIO = 1.15


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="stage_configs/smollm2_chain.yaml",
                   help="pipeline YAML (tiny_chain.yaml measures Ray's fixed per-step cost only)")
    p.add_argument("--stage-overrides", metavar="JSON", help="per-stage overrides (both parts)")
    p.add_argument("--num-requests", type=int, default=4, help="concurrent requests per repeat")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"),
                   help="prompt length range of the backend workload")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per backend (alternating)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every stage (0: the config's)")
    p.add_argument("--threads-per-stage", type=int, default=None,
                   help="torch threads of every stage's forward pass on both backends: this process's torch "
                   "threads and num_cpus of each stage actor (default: max(1, cores // stages); "
                   "0: leave both alone: torch's default here, the config's num_cpus on Ray)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (TTFT part)")
    p.add_argument("--conversations", type=int, default=2, help="conversations per caching setting")
    p.add_argument("--system-tokens", type=int, default=512, help="length of the first turn's prompt")
    p.add_argument("--turn-tokens", type=int, default=32, help="new user tokens per follow-up turn")
    p.add_argument("--ttft-backend", choices=["local", "ray"], default="local", help="backend of the TTFT part")
    p.add_argument("--skip-backends", action="store_true", help="only the TTFT part")
    p.add_argument("--skip-ttft", action="store_true", help="only the backend part")
    p.add_argument("--seed", type=int, default=0)


# ------------------------------------------------------------------ helpers
def _config_path(path: str) -> str:
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (ROOT / p).exists():
        p = ROOT / p
    return str(p)


def _sampling(cfg: Any, max_tokens: int | None) -> dict[str, Any] | None:
    return None if not max_tokens else {s.name: {"max_tokens": max_tokens} for s in cfg.stages}


def _stage_max_tokens(cfg: Any, max_tokens: int | None) -> dict[str, int]:
    return {s.name: max_tokens or s.sampling.max_tokens for s in cfg.stages}


def _merge(*overrides: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for o in overrides:
        for stage, fields in (o or {}).items():
            out.setdefault(stage, {}).update(fields)
    return out


def _check(outs: list[Any], what: str) -> None:
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} request(s) failed, e.g. {bad[0]}")


def _tokens(outs: list[Any]) -> list[dict[str, list[int]]]:
    return [{s: so.token_ids for s, so in o.outputs.items()} for o in outs]


def _ray_threads(omni: Any) -> dict[str, int | None]:
    """torch's intra-op threads inside each stage actor (from the stages' stats)."""
    return {name: st.get("torch_threads") for name, st in omni.stats()["stages"].items()}


# ------------------------------------------------------------ part 1: backends
def _ray_cpus(args: argparse.Namespace, cfg: Any) -> dict[str, float]:
    k = args.threads_per_stage
    return {s.name: k if k else s.resources.num_cpus for s in cfg.stages}


def _backend_overrides(args: argparse.Namespace, cfg: Any, base: dict[str, Any], backend: str) -> dict[str, Any]:
    """Every stage's forward pass with --threads-per-stage threads on both backends: num_cpus of each stage actor
    on Ray; in-process, the stages take turns on one polling thread, which gets the CPUs they reserve together
    (omni/pipeline/threads.py), so each reserves its share of one stage's threads."""
    k = args.threads_per_stage
    if backend == "ray":
        return _merge(base, {s: {"resources": {"num_cpus": n}} for s, n in _ray_cpus(args, cfg).items()})
    if not k:
        return base
    share = k / sum(s.replicas for s in cfg.stages)
    return _merge(base, {s.name: {"resources": {"num_cpus": share}} for s in cfg.stages})


def _step_timers(omni: Any) -> dict[str, dict[str, float]]:
    """Each stage's step timers (its first replica's stats: omni/pipeline/step_timers.py)."""
    return {stage: s["step_timers"] for stage, s in omni.stats()["stages"].items()}


def bench_backends(args: argparse.Namespace, cfg: Any, base_overrides: dict[str, Any]) -> dict[str, Any]:
    import torch

    from omni import Omni

    cores = os.cpu_count() or 1
    k = args.threads_per_stage
    ray_cpus = _ray_cpus(args, cfg)
    sampling = _sampling(cfg, args.max_tokens)
    lo, hi = args.prompt_tokens
    rng = random.Random(args.seed)
    workloads = [[{"prompt_token_ids": random_ids(rng, rng.randint(lo, hi))} for _ in range(args.num_requests)]
                 for _ in range(args.repeats)]
    warmup = [{"prompt_token_ids": random_ids(rng, rng.randint(lo, hi))} for _ in range(args.num_requests)]

    print(f"backends: {args.num_requests} concurrent requests x {args.repeats} repeats, prompts {lo}-{hi} "
          f"tokens, max_tokens {_stage_max_tokens(cfg, args.max_tokens)}")
    t0 = time.perf_counter()
    local = Omni(cfg, stage_overrides=_backend_overrides(args, cfg, base_overrides, "local") or None,
                 backend="local")
    ray_omni = None
    try:
        local_threads = _ray_threads(local)
        print(f"  local backend up in {time.perf_counter() - t0:.1f}s (torch threads per stage: {local_threads})")
        t0 = time.perf_counter()
        ray_omni = Omni(cfg, stage_overrides=_backend_overrides(args, cfg, base_overrides, "ray"), backend="ray")
        ray_threads = _ray_threads(ray_omni)
        print(f"  ray backend up in {time.perf_counter() - t0:.1f}s (num_cpus per stage: {ray_cpus}, "
              f"torch threads per stage actor: {ray_threads})")
        omnis = {"local": local, "ray": ray_omni}
        for name, o in omnis.items():
            _check(o.generate(warmup, sampling, use_tqdm=False), f"{name} warm-up")
        times: dict[str, list[float]] = {"local": [], "ray": []}
        tokens: dict[str, list[Any]] = {"local": [], "ray": []}
        num_tokens = 0
        timers_before = {name: _step_timers(o) for name, o in omnis.items()}
        for rep, prompts in enumerate(workloads):
            order = ("local", "ray") if rep % 2 == 0 else ("ray", "local")
            for name in order:
                t = time.perf_counter()
                outs = omnis[name].generate(prompts, sampling, use_tqdm=False)
                times[name].append(time.perf_counter() - t)
                _check(outs, f"{name} repeat {rep}")
                tokens[name].append(_tokens(outs))
                if name == "local":
                    num_tokens += sum(len(t) for o in _tokens(outs) for t in o.values())
            print(f"  repeat {rep}: local {times['local'][-1] * 1000:7.1f} ms, ray {times['ray'][-1] * 1000:7.1f} ms")
        steps = {name: {stage: overhead_ms(timers_before[name][stage], after)
                        for stage, after in _step_timers(o).items()} for name, o in omnis.items()}
    finally:
        local.close()
        if ray_omni is not None:
            ray_omni.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["ray"] / med["local"]
    same = tokens["local"] == tokens["ray"]
    print(f"  median end-to-end: local {med['local'] * 1000:.1f} ms, ray {med['ray'] * 1000:.1f} ms -> "
          f"ray/local {ratio:.3f} (target <= {TARGET_RATIO}); outputs identical: {same}")
    for stage, s in steps["ray"].items():
        here = steps["local"][stage]
        print(f"  {stage}: {s['steps']} steps, tick {s['tick_ms']:.2f} ms on Ray, {s['tick_cpu_ms']:.2f} of it on a "
              f"core ({here['tick_ms']:.2f}, {here['tick_cpu_ms']:.2f} in-process) + {s['overhead_ms']:.3f} ms the "
              f"actor adds (hop {s['hop_ms']:.3f}, dispatch {s['dispatch_ms']:.3f}, gap {s['gap_ms']:.3f})")
    return {
        "num_requests": args.num_requests, "repeats": args.repeats, "prompt_tokens": [lo, hi],
        "generated_tokens_per_repeat": num_tokens // max(1, args.repeats),
        "local_time_s": med["local"], "ray_time_s": med["ray"],
        "local_times_s": times["local"], "ray_times_s": times["ray"],
        "ray_over_local_time_ratio": ratio, "target_ratio": TARGET_RATIO, "within_target": ratio <= TARGET_RATIO,
        "outputs_identical": same,
        # per stage, per step (step_timers.py): what the Ray actor adds to a tick, split; each tick on both backends
        "ray_step_overhead_ms": {stage: s["overhead_ms"] for stage, s in steps["ray"].items()},
        "ray_step_split_ms": {stage: {k: s[k] for k in ("hop_ms", "dispatch_ms", "gap_ms")}
                              for stage, s in steps["ray"].items()},
        "tick_ms": {name: {stage: s["tick_ms"] for stage, s in by_stage.items()} for name, by_stage in steps.items()},
        "tick_cpu_ms": {name: {stage: s["tick_cpu_ms"] for stage, s in by_stage.items()}
                        for name, by_stage in steps.items()},
        "threads": {"cpu_count": cores, "local_torch_threads": torch.get_num_threads(),
                    "threads_per_stage_setting": k or None, "local_torch_threads_per_stage": local_threads,
                    "ray_num_cpus_per_stage": ray_cpus, "ray_torch_threads_per_stage": ray_threads},
    }


# --------------------------------------------------------------- part 2: TTFT
def _stage_ttfts(omni: Any, out: Any, before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Per-stage TTFT of one request: its own metrics for final stages, the stats' running mean otherwise."""
    res = {}
    for stage in omni.stage_names:
        so = out.outputs.get(stage)
        if so is not None and so.metrics.get("ttft_s"):
            res[stage] = so.metrics["ttft_s"]
            continue
        b, a = before[stage], after[stage]
        n0, n1 = b.get("finished", 0), a.get("finished", 0)
        if n1 > n0 and a.get("ttft_mean_s") is not None and n1 <= 1000:
            res[stage] = a["ttft_mean_s"] * n1 - (b.get("ttft_mean_s") or 0.0) * n0
    return res


def _conversation_turns(omni: Any, sampling: Any, rng: random.Random, args: argparse.Namespace,
                  budget: int) -> list[dict[str, Any]]:
    def questions():  # the first turn is the context alone; each next question drawn when its turn comes
        yield []
        for _ in range(args.turns - 1):
            yield random_ids(rng, args.turn_tokens)

    conv = Conversation(ids=random_ids(rng, args.system_tokens))
    turns = []
    for turn, prompt in conv.turns(questions()):
        if len(prompt) > budget:  # the next turn would not fit every stage's max_model_len
            break
        before = omni.stats()["stages"]
        [out] = omni.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
        after = omni.stats()["stages"]
        _check([out], f"turn {turn + 1}")
        first = omni.stage_names[0]
        entry = out.outputs.get(first)
        turns.append({"ttft": _stage_ttfts(omni, out, before, after),
                      "cached": {s: so.num_cached_tokens for s, so in out.outputs.items()},
                      "prompt_tokens": len(prompt), "tokens": _tokens([out])[0]})
        conv.answer(entry.token_ids if entry is not None else [])
    return turns


def bench_ttft(args: argparse.Namespace, cfg: Any, base_overrides: dict[str, Any]) -> dict[str, Any]:
    from omni import Omni

    stages = [s.name for s in cfg.stages]
    sampling = _sampling(cfg, args.max_tokens)
    max_tokens = _stage_max_tokens(cfg, args.max_tokens)
    # Longest first-stage prompt that leaves every stage room (a downstream stage's prompt may be as long
    # as the upstream prompt + its generated tokens).
    max_len = min((s.scheduler.max_model_len or 2048) for s in cfg.stages)
    budget = max_len - sum(max_tokens.values()) - 1
    if args.system_tokens > budget:
        raise ValueError(f"--system-tokens {args.system_tokens} does not fit max_model_len {max_len}")
    settings = {"on": {s: {"enable_prefix_caching": True} for s in stages},
                "off": {s: {"enable_prefix_caching": False} for s in stages}}
    print(f"TTFT: {args.conversations} conversations x {args.turns} turns ({args.system_tokens}-token first "
          f"turn, +reply +{args.turn_tokens} tokens per turn) on the {args.ttft_backend} backend, caching on vs off")
    omnis: dict[str, Any] = {}
    results: dict[str, list[list[dict[str, Any]]]] = {"on": [], "off": []}
    try:
        for key, ov in settings.items():
            overrides = _merge(_backend_overrides(args, cfg, base_overrides, args.ttft_backend), ov)
            omnis[key] = Omni(cfg, stage_overrides=overrides, backend=args.ttft_backend)
            warm = [{"prompt_token_ids": random_ids(random.Random(-1), args.system_tokens)}]
            _check(omnis[key].generate(warm, sampling, use_tqdm=False), f"warm-up (caching {key})")
        for c in range(args.conversations):
            order = ("on", "off") if c % 2 == 0 else ("off", "on")
            for key in order:  # same conversation (same seed) with caching on and off
                results[key].append(_conversation_turns(omnis[key], sampling, random.Random(args.seed * 1000 + c),
                                                  args, budget))
        stats = {k: o.stats()["stages"] for k, o in omnis.items()}
    finally:
        for o in omnis.values():
            o.close()

    same = all(t_on["tokens"] == t_off["tokens"] for conv_on, conv_off in zip(results["on"], results["off"])
               for t_on, t_off in zip(conv_on, conv_off))
    per_stage: dict[str, Any] = {}
    speedup: dict[str, float | None] = {}
    for stage in stages:
        row: dict[str, Any] = {}
        for key in ("on", "off"):
            later = [t["ttft"][stage] for conv in results[key] for t in conv[1:] if stage in t["ttft"]]
            first = [conv[0]["ttft"][stage] for conv in results[key] if stage in conv[0]["ttft"]]
            cached = [t["cached"].get(stage, 0) for conv in results[key] for t in conv[1:]]
            row[f"ttft_turn1_ms_{key}"] = statistics.mean(first) * 1000 if first else None
            row[f"ttft_turns2plus_ms_{key}"] = statistics.mean(later) * 1000 if later else None
            row[f"ttft_turns2plus_median_ms_{key}"] = statistics.median(later) * 1000 if later else None
            row[f"cached_tokens_turns2plus_{key}"] = statistics.mean(cached) if cached else None
            row[f"hit_rate_{key}"] = stats[key][stage].get("prefix_cache_hit_rate")
        on, off = row["ttft_turns2plus_ms_on"], row["ttft_turns2plus_ms_off"]
        speedup[stage] = off / on if on and off else None
        per_stage[stage] = row
        print(f"  {stage:>10}: TTFT turns 2+ on {on or float('nan'):7.2f} ms, off {off or float('nan'):7.2f} ms "
              f"-> {speedup[stage] or float('nan'):.2f}x; cached tokens/turn "
              f"{row['cached_tokens_turns2plus_on'] or 0:.0f}, hit rate {row['hit_rate_on'] or 0:.0%}")
    lengths = [t["prompt_tokens"] for t in results["on"][0]]
    print(f"  first-stage prompt lengths per turn: {lengths}; outputs identical on/off: {same}")
    return {"backend": args.ttft_backend, "conversations": args.conversations, "turns": len(lengths),
            "prompt_tokens_per_turn": lengths, "per_stage": per_stage, "per_stage_ttft_speedup": speedup,
            "outputs_identical": same}


# ---------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> dict[str, Any]:
    from omni.config.loader import load_config, parse_stage_overrides

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the embedded Ray needs no token auth
    for name in ("num_requests", "repeats", "conversations", "system_tokens", "turn_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")
    if args.turns < 2:
        raise SystemExit("error: --turns must be >= 2 (the TTFT speedup is over turns 2+)")
    lo, hi = args.prompt_tokens
    if not 1 <= lo <= hi:
        raise SystemExit(f"error: --prompt-tokens needs 1 <= MIN <= MAX, got {lo} {hi}")
    path = _config_path(args.config)
    base = parse_stage_overrides(args.stage_overrides)
    cfg = load_config(path, base or None)
    if args.threads_per_stage is None:
        args.threads_per_stage = max(1, (os.cpu_count() or 1) // len(cfg.stages))
    if args.threads_per_stage:
        import torch

        torch.set_num_threads(args.threads_per_stage)  # the local backend's stages (both parts)
    result: dict[str, Any] = {"bench": "pipeline", "config": path, "pipeline": cfg.name,
                              "stages": [s.name for s in cfg.stages], "cpu_count": os.cpu_count()}
    if not args.skip_backends:
        backends = bench_backends(args, cfg, base)
        result["ray_over_local_time_ratio"] = backends.pop("ray_over_local_time_ratio")
        result["ray_step_overhead_ms"] = backends.pop("ray_step_overhead_ms")
        result["threads"] = backends.pop("threads")
        result["backends"] = backends
    if not args.skip_ttft:
        ttft = bench_ttft(args, cfg, base)
        result["per_stage_ttft_speedup"] = ttft.pop("per_stage_ttft_speedup")
        result["ttft"] = ttft
    return result
