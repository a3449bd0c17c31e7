"""Multi-turn Qwen2.5-Omni conversation (thinker -> talker -> token2wav), prefix caching on vs off.

Every turn re-sends the whole conversation (an image and an audio clip in turn 1, the assistant's
earlier replies, a new user message), as a chat client does. Per turn we time:

    turn latency   submission -> waveform ready (all three stages)
    first audio    submission -> the talker's first codec token (what a streaming vocoder needs
                   to start playing; the thinker prefill and the talker prefill are on this path)

and report the mean over turns 2+ (turn 1 cannot hit), caching on vs off:
    turn_latency_speedup = mean(latency off) / mean(latency on), likewise first_audio_speedup.
`stage_s` splits each turn's time between thinker, talker and token2wav.
The stages run in this process, one engine each, built from the stage config like the runtime does
(edges plain: this benchmark is about the caches, `omni bench streaming` about streaming).

The default is the small random Qwen2.5-Omni (~95 M parameters) and a first message carrying a
~1,000-token document next to the image and the audio clip, so that from turn 2 on each stage
re-reads over 1,000 tokens of conversation: the prefill that prefix caching saves.

    omni bench omni [--config stage_configs/qwen2_5_omni_small.yaml] [--turns 4] [--doc-tokens 1000]
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

_USER_TURNS = [
    "Please describe the picture and the sound in as much detail as you can, then tell me a story.",
    "That is interesting. Can you tell me more about the colours and the shapes you noticed?",
    "Now summarise everything we talked about so far in three short sentences, please.",
    "Thank you. One last question: what would you change about the picture to make it calmer?",
    "Great. Say goodbye in a friendly way and remind me what we discussed today.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="stage_configs/qwen2_5_omni_small.yaml", help="Qwen2.5-Omni stage config")
    parser.add_argument("--doc-tokens", type=int, default=1000,
                        help="tokens of the document in the first message (0: none)")
    parser.add_argument("--turns", type=int, default=4, help="conversation turns (>= 2)")
    parser.add_argument("--thinker-max-tokens", type=int, default=16)
    parser.add_argument("--talker-max-tokens", type=int, default=32)
    parser.add_argument("--no-media", action="store_true", help="text-only conversation (no image/audio in turn 1)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="run each conversation this often on fresh engines; per turn, the fastest run counts")
    parser.add_argument("--seed", type=int, default=0)


def _engines(config: str, caching: bool, thinker_max: int, talker_max: int) -> dict[str, Any]:
    from omni.config_loader import load_config
    from omni.pipeline.engine_factory import build_engine

    overrides = {"thinker": {"enable_prefix_caching": caching, "sampling": {"max_tokens": thinker_max}},
                 "talker": {"enable_prefix_caching": caching, "sampling": {"max_tokens": talker_max},
                            "inputs": ["thinker"]},
                 "token2wav": {"inputs": ["talker"]}}
    cfg = load_config(config, stage_overrides=overrides)
    names = [s.name for s in cfg.stages]
    if names != ["thinker", "talker", "token2wav"]:
        raise ValueError(f"--config: expected stages thinker, talker, token2wav; got {names}")
    return {s.name: build_engine(s) for s in cfg.stages}


def _drain(engine, rid: str) -> Any:
    while True:
        for out in engine.step().finished:
            if out.request_id == rid:
                if out.error:
                    raise RuntimeError(f"stage {engine.name}: {out.error}")
                return out


def _turn(engines: dict[str, Any], rid: str, prompt: list[dict], mm: list) -> dict[str, Any]:
    from omni.outputs import StageInput
    from omni.registry import resolve_input_processor

    thinker2talker, talker2wav = resolve_input_processor("thinker2talker"), resolve_input_processor("talker2wav")
    inp = StageInput(rid, prompt=prompt, mm_inputs=mm)
    t0 = time.perf_counter()
    engines["thinker"].add_request(inp)
    thinker_out = _drain(engines["thinker"], rid)
    t_talker = time.perf_counter()
    engines["talker"].add_request(thinker2talker({"thinker": thinker_out}, inp))
    talker_out = _drain(engines["talker"], rid)
    t_wav = time.perf_counter()
    engines["token2wav"].add_request(talker2wav({"talker": talker_out}, inp))
    wav = _drain(engines["token2wav"], rid)
    t_end = time.perf_counter()
    return {"latency": t_end - t0, "first_audio": (t_talker - t0) + talker_out.metrics.get("ttft_s", 0.0),
            # where the turn's time went (the stages run one after the other here)
            "stage_s": {"thinker": t_talker - t0, "talker": t_wav - t_talker, "token2wav": t_end - t_wav},
            "outputs": (thinker_out, talker_out, wav)}


def _conversation(args, caching: bool) -> dict[str, Any]:
    from omni.outputs import MultiModalInput

    engines = _engines(args.config, caching, args.thinker_max_tokens, args.talker_max_tokens)
    rng = np.random.default_rng(args.seed)
    mm = [] if args.no_media else [
        MultiModalInput("image", rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)),
        MultiModalInput("audio", (0.1 * rng.standard_normal(32000)).astype(np.float32), 16000)]
    first = [{"type": m.modality} for m in mm]
    doc = ""
    if args.doc_tokens:
        from transformers import AutoTokenizer

        from .workloads import long_document

        doc = long_document(AutoTokenizer.from_pretrained(str(engines["thinker"].config.model_path)),
                            args.doc_tokens, args.seed) + "\n"
    messages: list[dict] = []
    latency, first_audio, stage_s, hits, outputs = [], [], [], [], []
    for turn in range(args.turns):
        text = (doc if turn == 0 else "") + _USER_TURNS[turn % len(_USER_TURNS)]
        content: Any = first + [{"type": "text", "text": text}] if turn == 0 and mm else text
        messages.append({"role": "user", "content": content})
        res = _turn(engines, f"turn{turn}", messages, mm)
        t_out, k_out, w_out = res["outputs"]
        latency.append(res["latency"])
        first_audio.append(res["first_audio"])
        stage_s.append({k: round(v, 4) for k, v in res["stage_s"].items()})
        hits.append({"thinker": t_out.num_cached_tokens, "talker": k_out.num_cached_tokens})
        outputs.append((t_out.token_ids, k_out.token_ids, w_out.audio))
        messages.append({"role": "assistant", "content": t_out.text or ""})
    keys = ("prefix_cache_hits", "prefix_cache_queries", "prefix_cache_hit_rate")
    stats = {name: {k: getattr(e.stats(), k) for k in keys} for name, e in engines.items()}
    encoder = getattr(engines["thinker"].model, "encoder_stats", None)
    return {"turn_latency_s": latency, "first_audio_s": first_audio, "stage_s": stage_s, "cached_tokens": hits,
            "stats": stats, "encoder": encoder() if encoder else None, "_outputs": outputs}


def _best_of(args, caching: bool) -> dict[str, Any]:
    runs = [_conversation(args, caching) for _ in range(max(1, args.repeats))]
    best = runs[-1]
    for key in ("turn_latency_s", "first_audio_s"):
        best[key] = [min(r[key][t] for r in runs) for t in range(args.turns)]
    # the breakdown of each turn's fastest run
    best["stage_s"] = [min(runs, key=lambda r: r["turn_latency_s"][t])["stage_s"][t] for t in range(args.turns)]
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.turns < 2:
        raise ValueError(f"--turns must be >= 2 (turn 1 cannot hit the cache), got {args.turns}")
    off = _best_of(args, caching=False)
    on = _best_of(args, caching=True)
    same = all(a[0] == b[0] and a[1] == b[1] and np.array_equal(a[2], b[2])
               for a, b in zip(on.pop("_outputs"), off.pop("_outputs")))

    def mean_after_first(xs: list[float]) -> float:
        return float(np.mean(xs[1:]))

    return {
        "benchmark": "omni",
        "config": args.config,
        "turns": args.turns,
        "caching_on": on,
        "caching_off": off,
        "outputs_identical": same,
        "turn_latency_speedup": mean_after_first(off["turn_latency_s"]) / mean_after_first(on["turn_latency_s"]),
        "first_audio_speedup": mean_after_first(off["first_audio_s"]) / mean_after_first(on["first_audio_s"]),
    }


if __name__ == "__main__":
    import json

    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    print(json.dumps(run(p.parse_args()), indent=2, default=str))
