"""A multi-turn chat through a multi-stage pipeline, with per-stage prefix caching.

    python examples/multi_turn.py                      # SmolLM2-135M chain on embedded Ray (`make demo`)
    python examples/multi_turn.py --compare            # run again with prefix caching off, side by side
    python examples/multi_turn.py --config stage_configs/qwen2_5_omni_tiny.yaml --backend local

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
# The first message carries a reference text, as a user pasting notes into a
# chat would: every later turn resends it, and the prefix cache serves it.
NOTES = """Travel notes on Paris.
Paris is the capital and largest city of France, on the river Seine in the north of the country.
The city is divided into twenty arrondissements that spiral out clockwise from the centre.
The Eiffel Tower was built by Gustave Eiffel's company for the 1889 World's Fair and is 330 metres tall.
The Louvre, once a royal palace, is the most visited art museum in the world; it holds the Mona Lisa
and the Venus de Milo, and its glass pyramid entrance was designed by I. M. Pei and opened in 1989.
The Musee d'Orsay, in a former railway station, holds impressionist paintings by Monet, Renoir and Degas.
Notre-Dame cathedral, on the Ile de la Cite, was damaged by fire in 2019 and reopened in December 2024.
Montmartre, on a hill in the north, is known for the Sacre-Coeur basilica and for the painters who
lived there, including Picasso and Van Gogh. The Latin Quarter, around the Sorbonne university, is
full of bookshops and small restaurants. The metro has sixteen lines and most sights are a short ride
apart. Parisian cafes serve croissants and coffee in the morning; bakeries sell baguettes all day, and
a typical dinner might be steak frites, onion soup or a crepe. The Seine is crossed by 37 bridges, the
oldest standing one being the Pont Neuf, finished in 1607. Many museums are free on the first Sunday of
the month. The Palace of Versailles, the former royal residence, lies about twenty kilometres west of the
city and can be reached by suburban train. The best seasons to visit are spring and early autumn, when
the parks such as the Luxembourg Gardens and the Tuileries are at their most pleasant."""
TURNS = [
    f"{NOTES}\n\nUsing these notes: what is the capital of France?",
    "According to the notes, what is Paris famous for?",
    "Recommend one museum to visit there.",
]


def per_turn_hit_rate(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    q = after.get("prefix_cache_queries", 0) - before.get("prefix_cache_queries", 0)
    h = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
    return h / q if q else None


def _count(n: int | None) -> str:
    return "   -" if n is None else f"{n:>4}"


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
        shown = question if len(question) < 200 else f"[travel notes, {len(NOTES)} chars] " + question.rsplit("\n", 1)[-1]
        print(f"\n[turn {turn}] user: {shown}\n[turn {turn}] thinker: {reply}")
        for stage in omni.stage_names:
            out = res.outputs.get(stage)
            rate = per_turn_hit_rate(before[stage], after[stage])
            ttft = out.metrics.get("ttft_s") if out else None
            row = {"turn": turn, "stage": stage, "ttft_ms": None if ttft is None else ttft * 1000,
                   "prompt_tokens": len(out.prompt_token_ids) if out else None,
                   "cached_tokens": out.num_cached_tokens if out else None, "hit_rate": rate}
            rows.append(row)
            # a stage without a token prompt (token2wav: codec codes in, a waveform out) has no counts
            print(f"  {stage:>8}: prompt {_count(row['prompt_tokens'])} tokens, "
                  f"{_count(row['cached_tokens'])} from the prefix cache (hit rate "
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
