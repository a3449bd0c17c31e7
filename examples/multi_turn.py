"""A multi-turn chat through a two-stage pipeline, with per-stage prefix caching.

    python examples/multi_turn.py                      # SmolLM2-135M chain on embedded Ray (`make demo`)
    python examples/multi_turn.py --compare            # run again with prefix caching off, side by side
    python examples/multi_turn.py --config stage_configs/tiny_chain.yaml --backend local

Every turn resends the whole conversation. The thinker finds the previous turns'
blocks in its prefix cache and only computes the new tokens; the talker, fed the
thinker's hidden states, finds the rows of the shared prefix too (its tensor cache
hands the cached rows downstream). So from the second turn on, each stage's
time to first token (TTFT) stays flat while the prompt keeps growing.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from omni import Omni

ROOT = Path(__file__).resolve().parents[1]

# No custom system prompt: SmolLM2's chat template supplies its own, and the
# 135M model (4-bit GGUF weights) answers best with it.
TURNS = [
    "What is the capital of France?",
    "What is it famous for?",
    "Recommend one museum to visit there.",
]


def per_turn_hit_rate(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    q = after.get("prefix_cache_queries", 0) - before.get("prefix_cache_queries", 0)
    h = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
    return h / q if q else None


def converse(omni: Omni, label: str) -> list[dict[str, Any]]:
    # Warm up every stage (first-forward overheads) on an unrelated prompt, so turn 1 is a fair baseline.
    omni.generate([{"prompt": [{"role": "user", "content": "Hi"}]}], use_tqdm=False)
    messages: list[dict[str, str]] = []
    rows = []
    print(f"\n=== {label} ===")
    for turn, question in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": question})
        before = omni.stats()["stages"]
        [res] = omni.generate([{"prompt": list(messages)}], use_tqdm=False)
        after = omni.stats()["stages"]
        if res.error:
            raise SystemExit(f"turn {turn} failed: {res.error}")
        reply = (res.outputs["thinker"].text or "").strip()
        print(f"\n[turn {turn}] user: {question}\n[turn {turn}] thinker: {reply}")
        for stage in omni.stage_names:
            out = res.outputs.get(stage)
            rate = per_turn_hit_rate(before[stage], after[stage])
            ttft = out.metrics.get("ttft_s") if out else None
            row = {"turn": turn, "stage": stage, "ttft_ms": None if ttft is None else ttft * 1000,
                   "prompt_tokens": len(out.prompt_token_ids) if out else None,
                   "cached_tokens": out.num_cached_tokens if out else None, "hit_rate": rate}
            rows.append(row)
            print(f"  {stage:>8}: prompt {row['prompt_tokens']:>4} tokens, "
                  f"{row['cached_tokens']:>4} from the prefix cache (hit rate "
                  f"{'-' if rate is None else f'{rate:.0%}'}), TTFT "
                  f"{'-' if ttft is None else f'{ttft * 1000:.1f} ms'}")
        messages.append({"role": "assistant", "content": reply})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "stage_configs" / "smollm2_chain.yaml"))
    ap.add_argument("--backend", choices=["ray", "local"], help="override runtime.backend")
    ap.add_argument("--compare", action="store_true", help="also run with prefix caching off on every stage")
    args = ap.parse_args()

    with Omni(args.config, backend=args.backend) as omni:
        print(f"pipeline {omni.config.name!r} on {omni.backend}: stages {', '.join(omni.stage_names)}")
        cached = converse(omni, "prefix caching on")
        stages = omni.stage_names
    if args.compare:
        off = {s: {"enable_prefix_caching": False} for s in stages}
        with Omni(args.config, stage_overrides=off, backend=args.backend) as omni:
            uncached = converse(omni, "prefix caching off")
        print("\nTTFT per turn (ms): caching on / off")
        for a, b in zip(cached, uncached):
            if a["ttft_ms"] and b["ttft_ms"]:
                print(f"  turn {a['turn']} {a['stage']:>8}: {a['ttft_ms']:7.1f} / {b['ttft_ms']:7.1f}"
                      f"   ({b['ttft_ms'] / a['ttft_ms']:.2f}x)")

    print("\nSummary (prefix caching on):")
    for stage in stages:
        mine = [r for r in cached if r["stage"] == stage]
        ttfts = ", ".join("-" if r["ttft_ms"] is None else f"{r['ttft_ms']:.1f}" for r in mine)
        hits = ", ".join("-" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}" for r in mine)
        print(f"  {stage:>8}: TTFT per turn [{ttfts}] ms; prefix-cache hit rate per turn [{hits}]")


if __name__ == "__main__":
    main()
