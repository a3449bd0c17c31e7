"""Offline inference through a multi-stage pipeline (vLLM-style).

    python examples/offline_pipeline.py                                   # tiny random models, embedded Ray
    python examples/offline_pipeline.py --config stage_configs/smollm2_chain.yaml --backend local
    python examples/offline_pipeline.py --stage-overrides '{"talker": {"enable_prefix_caching": false}}'

Every final stage's output comes back per request: the thinker's text and the talker's
token ids for the chain configs. `--stream` prints outputs as each stage finishes instead.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from omni import Omni, SamplingParams

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
            for out in omni.stream(prompts, params):
                what = out.error or (out.text if out.text is not None else out.token_ids)
                print(f"[{out.request_id}] {out.stage}: {what}")
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
