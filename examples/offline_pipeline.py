"""Offline inference through a multi-stage pipeline (vLLM-style).

    python examples/offline_pipeline.py                                   # tiny random models, embedded Ray
    python examples/offline_pipeline.py --config stage_configs/smollm2_chain.yaml --backend local
    python examples/offline_pipeline.py --stage-overrides '{"talker": {"enable_prefix_caching": false}}'
    python examples/offline_pipeline.py --stream --backend local          # progress as each stage makes it

Every final stage's output comes back per request: the thinker's text and the talker's
token ids for the chain configs. With `--stream` each stage's progress is printed as it comes (a
StageDelta: the tokens of a step, their text), then each final stage's StageOutput (or its error).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from omni import Omni, SamplingParams, StageOutput

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "stage_configs" / "tiny_chain.yaml"))
    ap.add_argument("--backend", choices=["ray", "local"], help="override runtime.backend")
    ap.add_argument("--stage-overrides", help="JSON, e.g. '{\"talker\": {\"enable_prefix_caching\": false}}'")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()

    prompts = [
        "The capital of France is",
        {"prompt": [{"role": "user", "content": "Name three primary colors."}]},  # chat messages
        {"prompt": "Write a haiku about the sea.", "request_id": "haiku"},
    ]
    overrides = json.loads(args.stage_overrides) if args.stage_overrides else None
    with Omni(args.config, stage_overrides=overrides, backend=args.backend) as omni:
        # One SamplingParams for every stage; a list (one per stage) or a dict
        # {stage: params} sets them per stage.
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        if args.stream:
            for item in omni.stream(prompts, params):
                if isinstance(item, StageOutput):  # a final stage finished the request (or it failed)
                    what = f"error: {item.error}" if item.error else f"done: text={item.text!r} tokens={item.token_ids}"
                else:  # a StageDelta: what one step generated
                    what = f"+{item.token_ids} {item.text!r}"
                print(f"[{item.request_id}] {item.stage}: {what}")
        else:
            for res in omni.generate(prompts, params):
                print(f"[{res.request_id}] {res.prompt!r}")
                if res.error:
                    print(f"  error: {res.error}")
                for stage, out in res.outputs.items():
                    print(f"  {stage}: text={out.text!r} tokens={out.token_ids[:12]}"
                          f"{'...' if len(out.token_ids) > 12 else ''} cached={out.num_cached_tokens}")
        for stage, s in omni.stats()["stages"].items():
            print(f"stage {stage}: prefix cache hit rate {s.get('prefix_cache_hit_rate')}, "
                  f"mean TTFT {s.get('ttft_mean_s')}")


if __name__ == "__main__":
    main()
