"""`omni bench tts`: a text-to-speech pipeline (default the small Higgs Audio v2) speaking in a few cloned voices:
prefix caching on vs off, streamed vs one-shot audio, omni at concurrency 4 vs transformers' generate, one run.

Requests: --voices voices, each a --reference-s reference (its codes [K, T] drawn once from a seeded generator at
the codec's frame rate, given to the stage as a named voice: every request in that voice repeats the whole
reference at the front of its prompt), --sentences sentences per voice (distinct texts). Greedy; every reply
--max-frames frames long (min_tokens = max_tokens: what the sentences take to say; a random model's stream-eos
comes at random frames, which is noise, not speech ending; --min-frames 0 lets it end). The pipelines run on the
config's backend (--backend to choose).

1. Time to first audio, one request at a time, on three pipelines: as configured (caching on, the model -> codec
   edge streamed), caching off, and the edge one-shot (plain). The first request of each voice is a miss on every
   pipeline and is not counted: `ttfa_ms` {on, off, oneshot} is the p50 over the requests after it.
   ttfa_speedup = off / on (target >= 3); voice_prefix_hit_rate = cached / prompt tokens of those requests (on);
   streaming_ttfa_speedup = oneshot / on (target >= 5).
2. Every request at once, --concurrency clients (closed loop, AsyncOmni) on the configured pipeline:
   audio_s_per_s_c4.
3. transformers' `HiggsAudioV2ForConditionalGeneration.generate` on the same requests, one after another, each
   reply's frames decoded by the same codec weights (references/higgs_audio_v2.py says how; the codec's own
   transformers class cannot load beside this torch): hf_audio_s_per_s; vs_hf_audio_s_per_s_c4 = omni's at
   concurrency 4 / transformers' (target >= 3); audio_identical = 1 when every one-shot omni waveform is the
   waveform of transformers' frames (same length, SNR >= SAME_FRAMES_DB: equal frames; audio_bitwise_equal: bit
   for bit, where both decode in one process); streamed_snr_db_min: the streamed waveforms against those (the
   chunked decode's bound, set by the first window's right context).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from omni.bench.measures import snr_db
from omni.messages import StageInput

SENTENCES = [
    "The sun rises in the east and sets in the west, as it has for thousands of years.",
    "Please remember to water the plants on the balcony before you leave for the weekend.",
    "Our train was delayed by twenty minutes because of a signal failure near the station.",
    "She opened the old wooden box and found a bundle of letters tied with a red ribbon.",
    "A good cup of coffee in the morning can make the whole day feel a little brighter.",
    "The museum will stay open late on Thursday evenings throughout the summer months.",
    "He practiced the piano every afternoon until the melody finally sounded right.",
    "Heavy rain is expected tomorrow, so bring an umbrella if you plan to go outside.",
]
RATE = 24000
# The same frames decoded in another process or thread count agree to ~100 dB (the codec's fp32 sums blocked
# otherwise); one different code of one frame puts a waveform below 20 dB.
SAME_FRAMES_DB = 80.0
TRANSCRIPT = "Hello, this is a recording of my voice, so that you can speak the way I do."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="stage_configs/higgs_audio_v2_small.yaml")
    p.add_argument("--voices", type=int, default=3)
    p.add_argument("--sentences", type=int, default=3, help="sentences per voice")
    p.add_argument("--reference-s", type=float, default=10.0, help="seconds of each voice's reference")
    p.add_argument("--max-frames", type=int, default=175, help="frames a reply may have (max_tokens; 175: 7 s at 25 "
                   "frames a second, what the sentences here take to say at 150 words a minute)")
    p.add_argument("--min-frames", type=int, help="frames before a reply may end (min_tokens; default: "
                   "--max-frames: every reply as long as its sentence takes to say, on both sides)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--backend", choices=["ray", "local"], help="the pipelines' backend (default: the config's)")


def _stages(config: Any) -> tuple[str, str]:
    """(the text-to-speech stage: the entry one; the audio stage: the final one)."""
    entry = next(s for s in config.stages if not s.inputs)
    audio = next(s for s in config.stages if s.final_output == "audio")
    return entry.name, audio.name


def _voices(config: Any, args, folder: Path) -> dict[str, np.ndarray]:
    """The voices' codes [K, T], written to `folder` as the stage's named voices read them."""
    from omni.registry import resolve_model_path

    entry = next(s for s in config.stages if not s.inputs)
    path = resolve_model_path(entry.model_path)
    cfg = json.loads((path / "config.json").read_text())
    codec = json.loads((path / "audio_tokenizer" / "config.json").read_text())
    hop = int(np.prod(codec["acoustic_model_config"]["downsampling_ratios"]))
    frames = int(round(args.reference_s * codec.get("sample_rate", 24000) / hop))
    rng = np.random.default_rng(0)
    voices = {}
    for v in range(args.voices):
        codes = rng.integers(0, cfg["audio_stream_bos_id"], size=(cfg["num_codebooks"], frames))
        np.save(folder / f"voice{v}.npy", codes)
        voices[f"voice{v}"] = codes
    return voices


def _overrides(tts: str, audio: str, folder: Path, voices: dict[str, np.ndarray], *, caching: bool,
               oneshot: bool, max_frames: int, min_frames: int = 0) -> dict[str, Any]:
    spec = {n: {"codes": str(folder / f"{n}.npy"), "text": TRANSCRIPT} for n in voices}
    ov: dict[str, Any] = {tts: {"enable_prefix_caching": caching, "model_kwargs": {"voices": spec},
                                "sampling": {"temperature": 0.0, "max_tokens": max_frames,
                                             "min_tokens": min_frames}}}
    if oneshot:
        ov[audio] = {"inputs": [tts]}
    return ov


def _requests(voices: dict[str, np.ndarray], per_voice: int) -> list[dict[str, Any]]:
    out = []
    for v, name in enumerate(voices):
        for s in range(per_voice):
            out.append({"prompt": SENTENCES[(v * per_voice + s) % len(SENTENCES)] + f" ({name}, {s + 1}.)",
                        "voice": name})
    return out


def _records(recs: list[Any], audio: str) -> list[dict[str, Any]]:
    out = []
    for r in recs:
        if r.error:
            raise RuntimeError(f"request {r.request_id} failed at stage {r.error_stage}: {r.error}")
        out.append({"ttfa_s": r.first_audio_at(audio), "audio": np.asarray(r.outputs[audio].audio, np.float32)})
    return out


async def _mode(args, tts: str, audio: str, folder: Path, voices, requests, **mode) -> dict[str, Any]:
    """One pipeline: every request alone (ttfa), and with `concurrency` clients when `concurrent`."""
    from omni import AsyncOmni
    from omni.bench.workloads import closed_loop_timed

    concurrent = mode.pop("concurrent", False)
    firsts = {min(i for i, q in enumerate(requests) if q["voice"] == r["voice"]) for r in requests}
    overrides = _overrides(tts, audio, folder, voices, max_frames=args.max_frames, min_frames=_min_frames(args),
                           **mode)
    omni = await AsyncOmni.create(args.config, overrides, args.backend)
    try:
        await closed_loop_timed(omni, [{"prompt": "Warm up, please."}], 1, id_prefix="warm")  # one-time costs
        before = (await omni.stats())["stages"][tts]
        recs = _records((await closed_loop_timed(omni, requests, 1, id_prefix="q"))[0], audio)
        after = (await omni.stats())["stages"][tts]
        later = [r["ttfa_s"] for i, r in enumerate(recs) if i not in firsts]
        result: dict[str, Any] = {"ttfa_ms_p50": 1000 * statistics.median(later), "records": recs,
                                  "hit_rate": _hit_rate(before, after)}
        if concurrent:
            got, wall = await closed_loop_timed(omni, requests, args.concurrency, id_prefix="c")
            seconds = sum(r["audio"].size / RATE for r in _records(got, audio))
            result["c4"] = {"audio_s": seconds, "wall_s": wall, "audio_s_per_s": seconds / wall}
            # transformers' prompts: omni's ids for each request (the voice's reference turn rendered by the stage)
            result["prompt_ids"] = [(await omni.tokenize(StageInput("t", prompt=r["prompt"],
                                                                    extra={"speaker": r["voice"]})))["tokens"]
                                    for r in requests]
    finally:
        await omni.close()
    return result


def _min_frames(args) -> int:
    return args.max_frames if args.min_frames is None else min(args.min_frames, args.max_frames)


def _hit_rate(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Cached over prompt tokens of the stage between two stats() (None when the stage counts neither)."""
    keys = ("prefix_cache_hits", "prefix_cache_queries")  # tokens
    if not all(k in after for k in keys):
        return None
    cached = after[keys[0]] - before.get(keys[0], 0)
    return cached / max(1, after[keys[1]] - before.get(keys[1], 0))


def run(args) -> dict[str, Any]:
    from omni.bench.references import higgs_audio_v2 as hf_ref
    from omni.config.loader import load_config
    from omni.registry import resolve_model_path

    config = load_config(args.config)
    tts, audio = _stages(config)
    folder = Path(tempfile.mkdtemp(prefix="omni-bench-tts-"))
    voices = _voices(config, args, folder)
    requests = _requests(voices, args.sentences)
    on = asyncio.run(_mode(args, tts, audio, folder, voices, requests, caching=True, oneshot=False,
                           concurrent=True))
    off = asyncio.run(_mode(args, tts, audio, folder, voices, requests, caching=False, oneshot=False))
    oneshot = asyncio.run(_mode(args, tts, audio, folder, voices, requests, caching=True, oneshot=True))

    # transformers: the same prompts (omni's ids, the voice's frames laid out by transformers' processor)
    ids = on["prompt_ids"]
    entry = next(s for s in config.stages if s.name == tts)
    codec_stage = next(s for s in config.stages if s.name == audio)
    model = hf_ref.load(resolve_model_path(entry.model_path))
    decoder = hf_ref.Decoder(codec_stage, tts)
    t0 = time.perf_counter()
    replies = [hf_ref.reply(model, decoder, p, voices[r["voice"]], args.max_frames, _min_frames(args))
               for p, r in zip(ids, requests)]
    hf_wall = time.perf_counter() - t0
    decoder.close()
    hf_audio_s = sum(len(r.audio) / RATE for r in replies)
    hf_rate = hf_audio_s / hf_wall
    pairs = list(zip(oneshot["records"], replies))
    bitwise = all(np.array_equal(o["audio"], h.audio) for o, h in pairs)
    identical = all(len(o["audio"]) == len(h.audio)
                    and (not len(h.audio) or snr_db(h.audio, o["audio"]) >= SAME_FRAMES_DB) for o, h in pairs)
    snrs = [snr_db(h.audio, o["audio"]) for o, h in zip(on["records"], replies)
            if len(h.audio) == len(o["audio"]) and len(h.audio)]
    later = len(requests) - len({r["voice"] for r in requests})
    return {
        "bench": "tts", "config": args.config, "voices": args.voices, "requests": len(requests),
        "reference_frames": int(next(iter(voices.values())).shape[1]), "max_frames": args.max_frames,
        "min_frames": _min_frames(args), "reply_frames": [len(r.frames) for r in replies],
        "ttfa_ms": {"on": on["ttfa_ms_p50"], "off": off["ttfa_ms_p50"], "oneshot": oneshot["ttfa_ms_p50"]},
        "ttfa_speedup": off["ttfa_ms_p50"] / on["ttfa_ms_p50"],
        "voice_prefix_hit_rate": on["hit_rate"], "hit_rate_off": off["hit_rate"],
        "streaming_ttfa_speedup": oneshot["ttfa_ms_p50"] / on["ttfa_ms_p50"],
        "audio_s_per_s_c4": on["c4"]["audio_s_per_s"], "hf_audio_s_per_s": hf_rate,
        "vs_hf_audio_s_per_s_c4": on["c4"]["audio_s_per_s"] / hf_rate,
        "audio_identical": int(identical), "audio_bitwise_equal": int(bitwise),
        "streamed_snr_db_min": min(snrs) if snrs else None,
        "counted_requests": later, "hf_generate_s": sum(r.generate_s for r in replies),
        "hf_decode_s": sum(r.decode_s for r in replies), "hf_wall_s": hf_wall,
        "targets": {"ttfa_speedup": 3, "streaming_ttfa_speedup": 5, "vs_hf_audio_s_per_s_c4": 3, "audio_identical": 1},
    }
