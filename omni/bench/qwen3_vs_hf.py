"""`omni bench qwen3-vs-hf`: Qwen3-Omni through omni vs transformers' generate, same requests, greedy, one run.

The small random Qwen3-Omni (stage_configs/qwen3_omni_small.yaml: thinker ~> talker ~> code2wav, streamed; the
three stages found from the config, audio_chain.py), every reply the same length (the thinker's
`--thinker-tokens`, the talker's `--reply-frames` codec frames: min_tokens = max_tokens, so both sides do the same
work), the same text requests ("Tell me a story about ...", the thinker's chat template):

1. omni (`--backend`, Ray by default: one actor per stage), closed loop (AsyncOmni.stream, capacity.py's
   structure): concurrency 1 over `--requests` prompts, then concurrency 4 over as many other prompts. Per level:
   TTFP (submission -> the first audio samples) p50/p99 in ms, end to end mean, requests_per_s (requests / wall).
2. transformers' Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True, talker_do_sample=False), greedy,
   on the concurrency-1 requests (the prompt ids omni's thinker built), one after another as a user runs it, in
   this process with this machine's cores (references/qwen3_omni.py). Its TTFP is its end to end (generate returns the
   waveform whole); its requests/s is what it serves at any concurrency (one at a time).

Keys: ttfp_speedup_c1 (transformers' time to audio / omni's TTFP, p50), e2e_speedup_c1 (transformers' mean end to
end / omni's), requests_per_s_speedup_c4 (omni at concurrency 4 over transformers), and audio_identical: 1 when for
every request omni's thinker tokens equal transformers', its codec frames' first codebook equals transformers' and
its waveform agrees with transformers' own code2wav on transformers' frames decoded in the windows omni's code2wav
streams (its first chunk, then chunk_frames doubling up to max_chunk_frames, each with chunked_decode's left context; a residual code that differs
changes the waveform): the same math, but the stage's actor computes with its own thread count (fp32 sums blocked
otherwise), so "agrees" is an SNR >= 100 dB as in `omni bench capacity`; waveform_bitwise_equal says whether they
are bit for bit equal (they are where the thread counts match, e.g. on the local backend). generate's own waveform is chunked_decode(300, 25): the same where omni's
windows are (a plain edge, or first_chunk_frames == chunk_frames == 300); with other windows each window drops a
few trailing samples (chunked_decode's own behaviour), so it is not compared sample by sample.

    omni bench qwen3-vs-hf [--config stage_configs/qwen3_omni_small.yaml] [--requests 8] [--reply-frames 63]
"""
from __future__ import annotations

import argparse
import asyncio
from typing import Any

import numpy as np

from omni.bench.audio_chain import AudioChain, audio_chain

FRAMES_PER_SECOND = 12.5  # Qwen3-Omni's talker: one codec frame per 80 ms of audio


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="stage_configs/qwen3_omni_small.yaml")
    p.add_argument("--backend", choices=["ray", "local"], default="ray")
    p.add_argument("--requests", type=int, default=8, help="requests per concurrency level (and for transformers)")
    p.add_argument("--thinker-tokens", type=int, default=32, help="text tokens of every reply")
    p.add_argument("--reply-frames", type=int, default=63, help="codec frames of every reply (63: ~5 s of audio)")
    p.add_argument("--seed", type=int, default=0)


def _overrides(chain: AudioChain, args) -> dict[str, Any]:
    from omni.bench.omni_streaming import omni_overrides

    ov = omni_overrides(chain, streaming=True, caching=True, audio_codes=args.reply_frames)
    n = args.thinker_tokens
    ov[chain.thinker]["sampling"] = {"temperature": 0.0, "max_tokens": n, "min_tokens": n}
    ov[chain.talker]["sampling"].update(temperature=0.0)
    ov[chain.talker]["final_output"] = "tokens"  # its first codebook, compared with transformers'
    return ov


def _prompts(n: int, tag: str) -> list[dict[str, Any]]:
    from omni.bench.omni_streaming import TOPICS

    return [{"prompt": f"Tell me a story about {TOPICS[i % len(TOPICS)]}, number {tag}-{i}."} for i in range(n)]


def _level(chain: AudioChain, recs: list[Any], wall_s: float) -> dict[str, Any]:
    from omni.bench.measures import percentile
    from omni.bench.omni_streaming import audio_times

    times = audio_times(recs, chain.audio)
    ttfp = [t["ttfp_s"] * 1000 for t in times]
    return {"requests": len(times), "wall_s": wall_s, "requests_per_s": len(times) / wall_s,
            "ttfp_p50_ms": percentile(ttfp, 50), "ttfp_p99_ms": percentile(ttfp, 99),
            "e2e_mean_s": float(np.mean([t["e2e_s"] for t in times])), "audio_s": sum(t["audio_s"] for t in times)}


async def _omni(args, chain: AudioChain) -> tuple[dict[int, Any], list[Any]]:
    from omni import AsyncOmni

    from omni.bench.workloads import closed_loop_timed

    out: dict[int, Any] = {}
    c1: list[Any] = []
    async with await AsyncOmni.create(args.config, stage_overrides=_overrides(chain, args),
                                      backend=args.backend) as o:
        await closed_loop_timed(o, [{"prompt": "Warm up, please."}], 1, id_prefix="warm")  # one-time costs
        for c in (1, 4):
            recs, wall = await closed_loop_timed(o, _prompts(args.requests, f"c{c}"), c, id_prefix=f"c{c}-")
            out[c] = _level(chain, recs, wall)
            if c == 1:
                c1 = recs
            print(f"omni c={c}: {out[c]['requests_per_s']:.3f} requests/s, TTFP p50 {out[c]['ttfp_p50_ms']:.0f} ms, "
                  f"end to end {out[c]['e2e_mean_s']:.2f} s", flush=True)
    return out, c1


def _windows(stage: Any) -> tuple[int, int, int, int]:
    """(first, chunk, left, max_chunk) frames of the windows the audio stage decodes (its model_kwargs, as it reads
    them; a plain edge decodes one shot: chunked_decode(max_chunk, left), every window alike)."""
    kw = stage.model_kwargs or {}
    chunk = int(kw.get("chunk_frames", 300))
    cap = int(kw.get("max_chunk_frames", chunk))
    left = int(kw.get("left_context_frames", 25))
    if not any(e.stream for e in stage.input_edges):
        return cap, cap, left, cap
    return int(kw.get("first_chunk_frames", chunk)), chunk, left, cap


def _hf(args, path, chain: AudioChain, windows: tuple[int, int, int, int], omni_c1: list[Any],
        device: str) -> dict[str, Any]:
    """transformers one request after another on omni's concurrency-1 requests, and its replies against omni's."""
    import torch

    from omni.pipeline.threads import available_cores

    from omni.bench.references import qwen3_omni as hf_qwen3_omni
    from omni.bench.measures import AGREE_SNR_DB, percentile, snr_db

    model = hf_qwen3_omni.load(path, device)
    threads = available_cores()  # what a user's process gets: this machine's cores
    torch.set_num_threads(threads)
    prompts = [list(rec.outputs[chain.thinker].prompt_token_ids) for rec in omni_c1]
    hf_qwen3_omni.reply(model, prompts[0], 2, 2)  # one-time costs out of the timing
    replies = [hf_qwen3_omni.reply(model, p, args.thinker_tokens, args.reply_frames) for p in prompts]
    total = sum(r.seconds for r in replies)
    tokens_same, codes_same, bitwise, snrs = True, True, True, []
    for r, rec in zip(replies, omni_c1):
        tokens_same &= list(rec.outputs[chain.thinker].token_ids) == r.thinker_ids
        codes_same &= len(r.frames) > 0 and \
            list(rec.outputs[chain.talker].token_ids)[: len(r.frames)] == r.frames[:, 0].tolist()
        got = np.asarray(rec.outputs[chain.audio].audio, dtype=np.float32)
        ref = hf_qwen3_omni.windowed_decode(model, r.frames, *windows) if len(r.frames) else r.audio
        same_len = got.shape == ref.shape
        bitwise &= same_len and bool(np.array_equal(got, ref))
        snrs.append(snr_db(ref, got) if same_len else float("-inf"))
    times = [r.seconds * 1000 for r in replies]
    return {"device": device, "threads": threads, "requests": len(replies), "wall_s": total,
            "requests_per_s": len(replies) / total,
            "ttfp_p50_ms": percentile(times, 50), "ttfp_p99_ms": percentile(times, 99),
            "e2e_mean_s": total / len(replies),
            "audio_s": sum(r.audio_s for r in replies), "thinker_tokens_identical": int(tokens_same),
            "first_codebook_identical": int(codes_same), "waveform_bitwise_equal": int(bitwise),
            "audio_snr_db_min": min(snrs),
            "audio_identical": int(tokens_same and codes_same and min(snrs) >= AGREE_SNR_DB)}


def run(args) -> dict[str, Any]:
    from omni.config.loader import load_config
    from omni.registry import resolve_model_path

    from omni.bench.capacity import hf_device

    if args.requests < 1 or args.thinker_tokens < 2 or args.reply_frames < 1:
        raise SystemExit("error: --requests >= 1, --thinker-tokens >= 2 (the talker starts on the thinker's second "
                         "token) and --reply-frames >= 1 are needed")
    cfg = load_config(args.config)
    chain = audio_chain(cfg)
    path = resolve_model_path(cfg.stage(chain.thinker).model_path)
    omni, c1 = asyncio.run(_omni(args, chain))
    hf = _hf(args, path, chain, _windows(cfg.stage(chain.audio)), c1, hf_device(cfg, chain.thinker))
    print(f"transformers: {hf['requests_per_s']:.3f} requests/s, {hf['ttfp_p50_ms']:.0f} ms per reply "
          f"({hf['threads']} threads); audio identical {hf['audio_identical']}", flush=True)
    return {
        "bench": "qwen3-vs-hf", "config": args.config, "backend": args.backend, "stages": chain.names,
        "requests_per_level": args.requests, "thinker_tokens": args.thinker_tokens, "reply_frames": args.reply_frames,
        "reply_seconds": args.reply_frames / FRAMES_PER_SECOND,
        "omni_c1": omni[1], "omni_c4": omni[4], "hf": hf,
        "ttfp_speedup_c1": hf["ttfp_p50_ms"] / omni[1]["ttfp_p50_ms"],
        "e2e_speedup_c1": hf["e2e_mean_s"] / omni[1]["e2e_mean_s"],
        "requests_per_s_speedup_c4": omni[4]["requests_per_s"] / hf["requests_per_s"],
        "audio_identical": hf["audio_identical"],
    }
