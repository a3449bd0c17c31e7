"""`omni bench realtime`: spoken multi-turn sessions over `/v1/realtime`, prefix caching on vs off (and, for a
pipeline with streaming edges, streamed vs plain edges), one run.

`omni serve CONFIG` processes (default: the small Qwen2.5-Omni): one as configured (prefix caching on), one with
`enable_prefix_caching: false` on every stage, and, when the config streams any edge (a voice agent's LLM -> TTS ->
codec), one with every edge plain (each stage starts when the one before it has finished: ASR, then the LLM, then the
TTS, as three services glued by an application run them). For each session count S (default 1 and 4), S sessions at
once on each server (the servers alternate, so a change of machine load hits all alike), each session --turns turns
with the real `openai` client (`client.realtime.connect`): the turn speaks --speech-s of real recorded speech (the next
part of the clip each turn: --speech-wav, default the sample clip the useful-moonshine-onnx package ships), commits
it and asks for a response; the turn latency is the time from sending the commit to the response's first
`response.output_audio.delta`. Every session has its own instructions (its number, then --instructions-words words
of a brief: the context every turn re-sends), so sessions never share a prefix: only a session's own earlier turns
can be hit.

JSON keys (S = the smallest session count; the same with a `_c4` suffix at 4 sessions):
    turn_latency_p50_ms           {"on": {"1": ms, "2": ...}, "off": {...}, "plain": {...}} p50 per turn index
    turn2plus_first_audio_speedup p50 over turns 2+ of off / on
    last_turn_caching_speedup     the last turn's p50, off / on (target >= 2)
    last_over_turn2_latency       on: p50 of the last turn / p50 of turn 2 (target <= 1.2: flat as the conversation
                                  grows; also as turn5_over_turn2_latency, its name when turns were 5)
    first_audio_speedup_vs_plain  p50 over all turns, plain edges / streamed edges (caching on both; target >= 3)
    cached_tokens_mean            {"on": {turn: mean cached tokens (usage: the text stage's)}, "off": {...}}
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import itertools
import json
import os
import statistics
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

from omni.bench.measures import percentile
from omni.bench.serve import NOTES
from omni.bench.server_process import serve_processes

RATE = 24000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="stage_configs/qwen2_5_omni_small.yaml")
    p.add_argument("--backend", choices=["ray", "local"], help="override runtime.backend (default: the config's)")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4], help="concurrent sessions (one run each)")
    p.add_argument("--turns", type=int, default=5, help="turns per session (>= 2)")
    p.add_argument("--speech-s", type=float, default=2.0, help="seconds of speech per turn")
    p.add_argument("--speech-wav", help="a mono 16-bit WAV of real speech (default: the moonshine sample clip)")
    p.add_argument("--max-output-tokens", type=int, default=32, help="the thinker's reply length per turn")
    p.add_argument("--instructions-words", type=int, default=600, help="words of session instructions (the "
                   "context every turn re-sends: what caching saves, and what grows the prompt without it)")
    p.add_argument("--voice", help="the session's voice (default: the server's)")


def default_speech() -> Path:
    spec = importlib.util.find_spec("moonshine_onnx")  # found, never imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no --speech-wav given and the useful-moonshine-onnx package (its sample clip of "
                                "recorded speech) is not installed: pip install --no-deps useful-moonshine-onnx")
    return Path(next(iter(spec.submodule_search_locations))) / "assets" / "beckett.wav"


def load_speech(path: Path) -> np.ndarray:
    """The clip as a float32 waveform at 24 kHz (the protocol's rate). The client resamples as a client
    would, on its own (linear interpolation: what the turns need is speech of the clip's length, not
    studio fidelity); the server's resampler is the server's."""
    with wave.open(str(path)) as w:
        if w.getnchannels() != 1 or w.getsampwidth() != 2:
            raise ValueError(f"--speech-wav: {path} must be mono 16-bit PCM")
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32767.0
    if rate == RATE or x.size == 0:
        return x
    n = max(1, round(x.size * RATE / rate))
    return np.interp(np.arange(n) * (rate / RATE), np.arange(x.size), x).astype(np.float32)


def instructions(index: int, words: int) -> str:
    """A session's own instructions: its number first (no two sessions share a cached block), then
    `words` words of a travel brief."""
    brief = " ".join(itertools.islice(itertools.cycle(NOTES.split()), words))
    return f"You are voice assistant number {index}. Answer briefly. {brief}"


async def _session(client: Any, model: str, index: int, speech: np.ndarray, args: Any) -> list[dict[str, float]]:
    """One session of --turns spoken turns: per turn, latency (s) and the thinker's cached tokens."""
    per_turn = int(args.speech_s * RATE)
    out = []
    async with client.realtime.connect(model=model) as conn:
        await conn.session.update(session={
            "type": "realtime", "instructions": instructions(index, args.instructions_words),
            "max_output_tokens": args.max_output_tokens,
            "audio": {"input": {"turn_detection": None},
                      "output": {"voice": args.voice} if args.voice else {}}})
        for t in range(args.turns):
            start = (t * per_turn) % max(1, speech.size - per_turn)
            pcm = (np.clip(speech[start:start + per_turn], -1, 1) * 32767).astype("<i2").tobytes()
            for i in range(0, len(pcm), RATE // 5 * 2):  # 200 ms appends, as a microphone sends them
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + RATE // 5 * 2]).decode())
            t0 = time.perf_counter()
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            first = None
            async for ev in conn:
                if ev.type == "response.output_audio.delta" and first is None:
                    first = time.perf_counter() - t0
                elif ev.type == "error":
                    raise RuntimeError(f"session {index} turn {t + 1}: {ev.error.message}")
                elif ev.type == "response.done":
                    # "incomplete": the reply stopped at its max_output_tokens (the bench's fixed reply length)
                    if ev.response.status not in ("completed", "incomplete") or first is None:
                        raise RuntimeError(f"session {index} turn {t + 1}: response {ev.response.status} "
                                           f"({ev.response.status_details}) with{'out' if first is None else ''} audio")
                    usage = ev.response.usage
                    out.append({"latency_s": first, "cached_tokens": usage.input_token_details.cached_tokens,
                                "input_tokens": usage.input_tokens})
                    break
    return out


async def _workload(url: str, model: str, sessions: int, offset: int, speech: np.ndarray, args: Any
                    ) -> list[list[dict[str, float]]]:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600) as client:
        return await asyncio.gather(*(_session(client, model, offset + i, speech, args) for i in range(sessions)))


def _run_on(mode: str, sessions: int, url: str, model: str, offset: int, speech: np.ndarray, args: Any
           ) -> list[list[dict[str, float]]]:
    """One server's run of `sessions` sessions; a failure names the server (caching on / off, plain edges)."""
    try:
        return asyncio.run(_workload(url, model, sessions, offset, speech, args))
    except Exception as e:
        raise RuntimeError(f"the {mode!r} server at {sessions} session(s): {e}") from e


def _summary(results: list[list[dict[str, float]]], turns: int) -> dict[str, Any]:
    lat = {t: [s[t]["latency_s"] * 1000 for s in results] for t in range(turns)}
    return {"turn_latency_p50_ms": {str(t + 1): percentile(v, 50) for t, v in lat.items()},
            "cached_tokens_mean": {str(t + 1): statistics.mean(s[t]["cached_tokens"] for s in results)
                                   for t in range(turns)},
            "input_tokens_mean": {str(t + 1): statistics.mean(s[t]["input_tokens"] for s in results)
                                  for t in range(turns)},
            "turn2plus_p50_ms": percentile([x for t, v in lat.items() if t >= 1 for x in v], 50),
            "all_p50_ms": percentile([x for v in lat.values() for x in v], 50)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from omni.config.loader import load_config

    if args.turns < 2:
        raise ValueError(f"--turns must be >= 2 (turn 2 on is what caching speeds up), got {args.turns}")
    cfg = load_config(args.config)
    speech = load_speech(Path(args.speech_wav) if args.speech_wav else default_speech())
    off = json.dumps({s.name: {"enable_prefix_caching": False} for s in cfg.stages})
    plain = {s.name: {"inputs": [getattr(e, "stage", e) for e in s.inputs]} for s in cfg.stages
             if any(getattr(e, "stream", False) for e in s.inputs)}  # `inputs: [name]` or [{stage, stream, ...}]
    common = ["--port", "0", "--log-level", "warning", "--max-sessions", str(max(args.sessions) + 1),
              *(["--backend", args.backend] if args.backend else [])]
    env = {**os.environ, "OMNI_API_KEY": ""}
    result: dict[str, Any] = {"config": cfg.name, "sessions": args.sessions, "turns": args.turns,
                              "speech_s": args.speech_s, "loadavg_before": [round(x, 2) for x in os.getloadavg()],
                              "runs": {}}
    modes = {"on": common, "off": [*common, "--stage-overrides", off],
             **({"plain": [*common, "--stage-overrides", json.dumps(plain)]} if plain else {})}
    with serve_processes([(args.config, a) for a in modes.values()], env=env) as procs:
        servers = {mode: p.url for mode, p in zip(modes, procs)}
        one_turn = argparse.Namespace(**{**vars(args), "turns": 1})

        async def warm_up() -> None:  # one-time costs (first forward passes) out of the timing, all servers at once
            await asyncio.gather(*(_workload(url, cfg.name, 1, 10_000, speech, one_turn) for url in servers.values()))

        asyncio.run(warm_up())
        offset = 0
        for n in args.sessions:
            entry: dict[str, Any] = {mode: _summary(_run_on(mode, n, url, cfg.name, offset, speech, args), args.turns)
                                     for mode, url in servers.items()}
            offset += n
            entry.update(_ratios(entry, args.turns))
            result["runs"][f"c{n}"] = entry
            print(f"{cfg.name} {n} session(s): turn p50 ms "
                  + "; ".join(f"{m} {entry[m]['turn_latency_p50_ms']}" for m in servers)
                  + f"; {json.dumps({k: round(v, 2) for k, v in _ratios(entry, args.turns).items()})}", flush=True)
    for i, n in enumerate(args.sessions):
        entry = result["runs"][f"c{n}"]
        suffix = "" if i == 0 else f"_c{n}"
        result[f"turn_latency_p50_ms{suffix}"] = {m: entry[m]["turn_latency_p50_ms"] for m in servers}
        result[f"cached_tokens_mean{suffix}"] = {m: entry[m]["cached_tokens_mean"] for m in ("on", "off")}
        for key, value in _ratios(entry, args.turns).items():
            result[f"{key}{suffix}"] = value
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _ratios(entry: dict[str, Any], turns: int) -> dict[str, float]:
    on, off = entry["on"], entry["off"]
    last = str(turns)
    out = {"turn2plus_first_audio_speedup": off["turn2plus_p50_ms"] / on["turn2plus_p50_ms"],
           "last_turn_caching_speedup": off["turn_latency_p50_ms"][last] / on["turn_latency_p50_ms"][last],
           "last_over_turn2_latency": on["turn_latency_p50_ms"][last] / on["turn_latency_p50_ms"]["2"]}
    out["turn5_over_turn2_latency"] = out["last_over_turn2_latency"]
    if "plain" in entry:
        out["first_audio_speedup_vs_plain"] = entry["plain"]["all_p50_ms"] / on["all_p50_ms"]
    return out
