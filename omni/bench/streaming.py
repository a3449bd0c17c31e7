"""`omni bench streaming`: a streaming edge vs a plain one, same pipeline, same requests, one run.

The SmolLM2 chain (thinker -> talker fed the thinker's hidden states) on the Ray backend (one actor
per stage, so the two stages really run side by side). The thinker reads a ~500-token document and
writes 256 tokens (ignore_eos); the talker then writes its own tokens. With `stream: true` on the
edge the talker admits the request on the thinker's first chunk and prefills the document and the
reply rows while the thinker is still decoding (a plain LM fed embeddings cannot decode before its
input is complete, so only its prefill overlaps); without it, the talker starts from scratch once
the thinker is done.

Per request we time, from submission: the talker's first token (what a downstream consumer waits
for) and the end. Concurrency 1 and 4, both modes. JSON keys:

    chain_first_token_speedup   talker first token, non-streaming / streaming (concurrency 1; >= 1.1)
    chain_e2e_ratio             end to end, streaming / non-streaming (concurrency 1; <= 1.0)
    ..._c4                      the same at concurrency 4
    thinker_tokens_identical    1 when the thinker's greedy tokens are the same in both modes

`--pipeline omni` (or `both`, the default) adds the small Qwen2.5-Omni with audio: time to first
audio and real-time factor, streaming vs not (omni_streaming.py); `--pipeline qwen3-omni` runs that part
alone on the small Qwen3-Omni (thinker ~> talker ~> code2wav):

    omni bench streaming --pipeline qwen3-omni [--omni-config stage_configs/qwen3_omni_small.yaml]
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="stage_configs/smollm2_chain.yaml")
    p.add_argument("--backend", default="ray", choices=["ray", "local"])
    p.add_argument("--doc-tokens", type=int, default=500, help="tokens of the document each prompt carries")
    p.add_argument("--thinker-tokens", type=int, default=256)
    p.add_argument("--talker-tokens", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pipeline", choices=["chain", "omni", "qwen3-omni", "both"], default="both",
                   help="chain (SmolLM2), omni (Qwen2.5-Omni), both of these, or qwen3-omni (Qwen3-Omni alone)")
    p.add_argument("--omni-config", default=None,
                   help="the omni pipeline's config (default: stage_configs/qwen2_5_omni_small.yaml, "
                        "stage_configs/qwen3_omni_small.yaml with --pipeline qwen3-omni)")
    p.add_argument("--omni-turns", type=int, default=3, help="turns of the TTFP-per-turn conversation")
    p.add_argument("--omni-doc-tokens", type=int, default=1000, help="tokens of the first message's document")
    p.add_argument("--omni-audio-codes", type=int, default=None,
                   help="talker tokens of every omni reply (default 5 s of audio: 250 Qwen2.5-Omni codec tokens, "
                        "50 a second; 63 Qwen3-Omni frames, 12.5 a second; 0: as the model stops)")
    p.add_argument("--omni-repeats", type=int, default=5,
                   help="omni requests timed at concurrency 1 (two cores shared by three stages: TTFP varies ~1.5x)")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw TTFP per turn (omni) into this PNG file")


def _prompts(path, args, n: int, offset: int) -> list[str]:
    from transformers import AutoTokenizer

    from omni.bench.workloads import long_document

    tok = AutoTokenizer.from_pretrained(str(path))
    return [long_document(tok, args.doc_tokens, args.seed + offset + i) + "\nSummarise the table."
            for i in range(n)]


def _overrides(args, stream: bool) -> dict[str, Any]:
    return {
        "thinker": {"sampling": {"temperature": 0.0, "max_tokens": args.thinker_tokens, "ignore_eos": True},
                    "enable_prefix_caching": False},
        "talker": {"inputs": [{"stage": "thinker", "stream": stream, "chunk_tokens": args.chunk_tokens}],
                   "sampling": {"temperature": 0.0, "max_tokens": args.talker_tokens, "ignore_eos": True},
                   "enable_prefix_caching": False},
    }


def _run_batch(omni, prompts: list[str]) -> list[dict[str, Any]]:
    """Submit all prompts at once; per request: first talker token, end, thinker tokens."""
    from omni.bench.workloads import stream_timed

    out = []
    for r in stream_timed(omni, prompts):
        if r.error:
            raise RuntimeError(f"request {r.request_id} failed: {r.error}")
        out.append({"first_token_s": r.first_token_s.get("talker"),
                    "e2e_s": max((t for s, t in r.output_s.items() if s != "thinker"), default=None),
                    "thinker_tokens": list(r.outputs["thinker"].token_ids)})
    return out


def _mode(args, stream: bool, batches: dict[int, list[str]]) -> tuple[dict[str, Any], dict[int, list]]:
    from omni import Omni

    with Omni(args.config, backend=args.backend, stage_overrides=_overrides(args, stream)) as o:
        _run_batch(o, ["Warm up: say hello."])  # one-time costs out of the timing
        out, tokens = {}, {}
        for c, prompts in batches.items():
            recs = _run_batch(o, prompts)
            tokens[c] = [r["thinker_tokens"] for r in recs]
            out[f"c{c}"] = {
                "first_token_s": statistics.mean(r["first_token_s"] for r in recs),
                "e2e_s": statistics.mean(r["e2e_s"] for r in recs),
            }
            print(f"{'streaming' if stream else 'non-streaming'} c={c}: talker first token "
                  f"{out[f'c{c}']['first_token_s']:.2f}s, end to end {out[f'c{c}']['e2e_s']:.2f}s", flush=True)
    return out, tokens


def run(args) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if args.pipeline in ("chain", "both"):
        result.update(run_chain(args))
    if args.pipeline in ("omni", "qwen3-omni", "both"):
        from omni.bench.omni_streaming import run_omni

        result.update(run_omni(args))
    return result


def run_chain(args) -> dict[str, Any]:
    from omni.config.loader import load_config
    from omni.registry import resolve_model_path

    cfg = load_config(args.config)
    path = resolve_model_path(cfg.stage("thinker").model_path)
    batches, offset = {}, 0
    for c in args.concurrency:
        batches[c] = _prompts(path, args, c, offset)
        offset += c
    plain, plain_tokens = _mode(args, False, batches)
    streamed, streamed_tokens = _mode(args, True, batches)
    result: dict[str, Any] = {
        "config": args.config, "backend": args.backend, "doc_tokens": args.doc_tokens,
        "thinker_tokens": args.thinker_tokens, "talker_tokens": args.talker_tokens,
        "chunk_tokens": args.chunk_tokens, "non_streaming": plain, "streaming": streamed,
        "thinker_tokens_identical": int(plain_tokens == streamed_tokens),
    }
    for c in args.concurrency:
        sfx = "" if c == 1 else f"_c{c}"
        result[f"chain_first_token_speedup{sfx}"] = (plain[f"c{c}"]["first_token_s"]
                                                     / streamed[f"c{c}"]["first_token_s"])
        result[f"chain_e2e_ratio{sfx}"] = streamed[f"c{c}"]["e2e_s"] / plain[f"c{c}"]["e2e_s"]
    return result
