"""Multi-turn omni conversation (thinker -> talker -> token2wav / code2wav), prefix caching on vs off.

Every turn re-sends the whole conversation (an image and an audio clip in turn 1, the assistant's
earlier replies, a new user message), as a chat client does. (Qwen3-Omni's talker refuses an image and a
clip in one conversation: `--media auto`, the default, then sends the image only; `--media audio` the clip.) Per turn we time:

    turn latency   submission -> waveform ready (all three stages)
    first audio    submission -> the talker's first codec token (what a streaming vocoder needs
                   to start playing; the thinker prefill and the talker prefill are on this path)
    first waveform submission -> the first audio samples reaching the caller (what a listener hears
                   first: with streaming edges the audio stage's first chunk, with plain ones the
                   whole waveform)

and report the mean over turns 2+ (turn 1 cannot hit), caching on vs off:
    turn_latency_speedup = mean(latency off) / mean(latency on), likewise first_audio_speedup and
    first_waveform_speedup.
`stage_s` splits each turn's time between thinker, talker and the audio stage (from the submission to the
thinker's output, then to the talker's, then to the waveform; with streaming edges the stages overlap, so
a later stage's share is only what it ran on after the one before had finished). The three stages are found
from the config (audio_chain.py: the stage whose final output is audio, its input, that one's input), so
Qwen2.5-Omni (token2wav) and Qwen3-Omni (code2wav) run the same benchmark.
The YAML pipeline runs through `Omni`, as a user runs it: its own edges (`--edges config`, the default:
the shipped configs stream thinker ~> talker ~> audio stage; `--edges plain` makes both edges plain, so
the talker starts once the thinker has finished, as this benchmark ran before 2026-11-24), on the local
backend by default (every stage in this process, as the numbers in README were taken; --backend ray for one
actor per stage), and the talker's tokens returned too (final_output: tokens), for its cache hits and the
outputs check.

The default is the small random Qwen2.5-Omni (~95 M parameters; `--config
stage_configs/qwen3_omni_small.yaml` for the small Qwen3-Omni) and a first message carrying a
~1,000-token document next to the image and the audio clip, so that from turn 2 on each stage
re-reads over 1,000 tokens of conversation: the prefill that prefix caching saves.

    omni bench omni [--config stage_configs/qwen2_5_omni_small.yaml] [--turns 4] [--doc-tokens 1000]
                    [--backend local|ray] [--edges config|plain]
"""
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from omni.bench.audio_chain import AudioChain, audio_chain

_USER_TURNS = [
    "Please describe the picture and the sound in as much detail as you can, then tell me a story.",
    "That is interesting. Can you tell me more about the colours and the shapes you noticed?",
    "Now summarise everything we talked about so far in three short sentences, please.",
    "Thank you. One last question: what would you change about the picture to make it calmer?",
    "Great. Say goodbye in a friendly way and remind me what we discussed today.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="stage_configs/qwen2_5_omni_small.yaml", help="an omni stage config (thinker -> talker -> audio stage)")
    parser.add_argument("--backend", choices=["local", "ray"], default="local",
                        help="the pipeline's backend (default: local, every stage in this process)")
    parser.add_argument("--edges", choices=["config", "plain"], default="config",
                        help="the config's own edges (default; the shipped configs stream) or both edges plain")
    parser.add_argument("--doc-tokens", type=int, default=1000,
                        help="tokens of the document in the first message (0: none)")
    parser.add_argument("--turns", type=int, default=4, help="conversation turns (>= 2)")
    parser.add_argument("--thinker-max-tokens", type=int, default=16)
    parser.add_argument("--talker-max-tokens", type=int, default=32)
    parser.add_argument("--no-media", action="store_true", help="text-only conversation (no image/audio in turn 1)")
    parser.add_argument("--media", choices=["auto", "image+audio", "image", "audio"], default="auto",
                        help="what turn 1 carries next to its text (auto: an image and an audio clip, or only the "
                             "image where the talker refuses both in one conversation: Qwen3-Omni's)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="run each conversation this often on fresh pipelines, caching off and on in turn; "
                             "per turn, the fastest run counts")
    parser.add_argument("--seed", type=int, default=0)


def _pipeline(args, caching: bool, chain: AudioChain) -> Any:
    from omni import Omni
    from omni.config.loader import load_config

    overrides = {chain.thinker: {"enable_prefix_caching": caching,
                                 "sampling": {"max_tokens": args.thinker_max_tokens}},
                 chain.talker: {"enable_prefix_caching": caching, "sampling": {"max_tokens": args.talker_max_tokens},
                                "final_output": "tokens"}}
    for stage, edges in (chain.plain_edges() if args.edges == "plain" else {}).items():
        overrides.setdefault(stage, {}).update(edges)
    return Omni(load_config(args.config, stage_overrides=overrides), backend=args.backend)


def _turn(omni: Any, chain: AudioChain, rid: str, prompt: list[dict], mm: dict[str, Any]) -> dict[str, Any]:
    from omni.bench.workloads import stream_timed

    [r] = stream_timed(omni, [{"prompt": prompt, "multi_modal_data": mm, "request_id": rid}])
    if r.error:
        raise RuntimeError(f"stage {r.error_stage}: {r.error}")
    t_talker, t_wav, t_end = (r.output_s[s] for s in chain.names)
    return {"latency": t_end,
            # the talker's first codec token: what a streaming vocoder needs to start playing
            "first_audio": r.first_token_s[chain.talker],
            # what the caller gets first: a streamed chunk, or (plain edges) the whole waveform
            "first_waveform": r.first_audio_at(chain.audio),
            # where the turn's time went (each stage's output after the one before)
            "stage_s": {chain.thinker: t_talker, chain.talker: t_wav - t_talker, chain.audio: t_end - t_wav},
            "outputs": tuple(r.outputs[s] for s in chain.names)}


def _media(args, chain: AudioChain, rng: Any) -> dict[str, Any]:
    """turn 1's media: --media, or with `auto` both unless the talker refuses them together (AudioChain.media)."""
    if args.no_media:
        return {}
    return chain.media(rng, None if args.media == "auto" else args.media.split("+"))


def _run_conversation(args, caching: bool, chain: AudioChain) -> dict[str, Any]:
    """One conversation of --turns turns on a fresh pipeline: per turn its timings, hits and outputs."""
    from omni.registry import resolve_model_path

    from omni.bench.workloads import Conversation, with_media

    omni = _pipeline(args, caching, chain)
    try:
        rng = np.random.default_rng(args.seed)
        mm = _media(args, chain, rng)
        doc = ""
        if args.doc_tokens:
            from transformers import AutoTokenizer

            from omni.bench.workloads import long_document

            path = resolve_model_path(omni.config.stage(chain.thinker).model_path)
            doc = long_document(AutoTokenizer.from_pretrained(str(path)), args.doc_tokens, args.seed) + "\n"
        conv = Conversation(messages=[])
        latency, first_audio, first_waveform, stage_s, hits, outputs = [], [], [], [], [], []
        questions = (with_media(mm, doc + _USER_TURNS[0]) if turn == 0 else _USER_TURNS[turn % len(_USER_TURNS)]
                     for turn in range(args.turns))
        for turn, prompt in conv.turns(questions):
            res = _turn(omni, chain, f"turn{turn}", prompt, mm)
            t_out, k_out, w_out = res["outputs"]
            latency.append(res["latency"])
            first_audio.append(res["first_audio"])
            first_waveform.append(res["first_waveform"])
            stage_s.append({k: round(v, 4) for k, v in res["stage_s"].items()})
            hits.append({chain.thinker: t_out.num_cached_tokens, chain.talker: k_out.num_cached_tokens})
            outputs.append((t_out.token_ids, k_out.token_ids, w_out.audio))
            conv.answer(t_out.text or "")
        stages = omni.stats()["stages"]
    finally:
        omni.close()
    keys = ("prefix_cache_hits", "prefix_cache_queries", "prefix_cache_hit_rate")
    stats = {name: {k: stages[name].get(k) for k in keys} for name in chain.names}
    encoder_keys = ("encoder_runs", "encoder_cache_hits", "encoder_cache_entries")  # the thinker model's counters
    thinker = stages[chain.thinker]
    encoder = {k: thinker[k] for k in encoder_keys} if "encoder_runs" in thinker else None
    return {"turn_latency_s": latency, "first_audio_s": first_audio, "first_waveform_s": first_waveform,
            "stage_s": stage_s, "cached_tokens": hits,
            "media": sorted(mm), "stats": stats, "encoder": encoder, "_outputs": outputs}


def _best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per turn, the fastest of `runs` (the same conversation on fresh pipelines)."""
    best = runs[-1]
    turns = len(best["turn_latency_s"])
    for key in ("turn_latency_s", "first_audio_s", "first_waveform_s"):
        best[key] = [min(r[key][t] for r in runs) for t in range(turns)]
    # the breakdown of each turn's fastest run
    best["stage_s"] = [min(runs, key=lambda r: r["turn_latency_s"][t])["stage_s"][t] for t in range(turns)]
    return best


def _interleaved(args, chain: AudioChain) -> tuple[dict[str, Any], dict[str, Any]]:
    """Caching off and on, run after run in turn (off, on, off, on, ...), each its fastest per turn: a
    machine whose speed drifts over the minute the benchmark takes (a shared or virtual one: consecutive
    runs differ by up to 20% here) slows both sides alike, instead of all of one side's runs."""
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(max(1, args.repeats)):
        for caching in (False, True):
            runs[caching].append(_run_conversation(args, caching, chain))
    return _best_of(runs[False]), _best_of(runs[True])


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.turns < 2:
        raise ValueError(f"--turns must be >= 2 (turn 1 cannot hit the cache), got {args.turns}")
    chain = audio_chain(args.config)
    off, on = _interleaved(args, chain)
    pairs = list(zip(on.pop("_outputs"), off.pop("_outputs")))
    tokens_same = all(a[0] == b[0] and a[1] == b[1] for a, b in pairs)
    same = tokens_same and all(np.array_equal(a[2], b[2]) for a, b in pairs)
    # Where the waveforms are not bit for bit equal (a GPU's kernels need not sum in one order from run to run),
    # how close they are: the worst turn's SNR of caching on against caching off.
    from omni.bench.measures import snr_db

    snr = min((snr_db(np.asarray(b[2]), np.asarray(a[2])) if np.shape(a[2]) == np.shape(b[2]) else float("-inf")
               for a, b in pairs), default=float("inf"))

    def mean_after_first(xs: list[float]) -> float:
        return float(np.mean(xs[1:]))

    return {
        "benchmark": "omni",
        "config": args.config,
        "stages": chain.names,
        "turns": args.turns,
        "edges": args.edges,
        "caching_on": on,
        "caching_off": off,
        "outputs_identical": same,
        "tokens_identical": tokens_same,
        "audio_snr_db_min": snr if np.isfinite(snr) else None,  # None: every waveform bit for bit equal
        "turn_latency_speedup": mean_after_first(off["turn_latency_s"]) / mean_after_first(on["turn_latency_s"]),
        "first_audio_speedup": mean_after_first(off["first_audio_s"]) / mean_after_first(on["first_audio_s"]),
        "first_waveform_speedup": mean_after_first(off["first_waveform_s"]) / mean_after_first(on["first_waveform_s"]),
    }


if __name__ == "__main__":
    import json

    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    print(json.dumps(run(p.parse_args()), indent=2, default=str))
