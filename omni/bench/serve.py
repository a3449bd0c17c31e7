"""`omni bench serve`: the OpenAI server vs AsyncOmni in-process, on the same multi-turn workload, one run.

For each config (default: the SmolLM2 chain, and the small Qwen2.5-Omni with text + audio replies) and
each concurrency C (default 1, 4, 16): C conversations of --turns turns run at once, each turn a
streamed chat completion whose reply goes into the next turn (so turns 2+ hit the prefix cache).

    in-process  the same conversations on AsyncOmni in this process (AsyncOmni.stream with the chat
                messages): the pipeline the server serves, without the server
    http        `omni serve CONFIG` in a subprocess, driven by openai.AsyncOpenAI (streaming): the server's
                whole path (parsing, translation, SSE, HTTP, a process of its own) on the same pipeline

Each mode has its own pipeline, both loaded for the whole run; the modes alternate per concurrency (a
change of machine load hits both alike; concurrency 1, with few requests, runs --repeats rounds). Both
use the config's backend (--backend to override). Per mode and concurrency: requests/s, TTFT (first
text) and TTFP (first audio) p50/p99, end-to-end p50/mean. JSON keys (the first config, the
SmolLM2 chain): http_overhead_ratio (http / in-process mean end to end at concurrency 1; target
<= 1.10), ttft_p99_ms_c16 and requests_per_s_c16 (http); for the omni config the same with an
`omni_` prefix, and ttfp_p99_ms_c16.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from omni.bench.measures import percentile
from omni.bench.server_process import serve_process
from omni.bench.workloads import Conversation
from omni.messages import StageDelta

NOTES = ("I am planning a slow trip along the coast: three nights in the old harbour town, a day on the ferry "
         "to the islands, then a week walking between the hill villages, staying in small guest houses and "
         "eating wherever the fishermen eat. I would like quiet places, good bread and long walks.")
_IDS = itertools.count()
TURNS = ["Where should I start, and why?", "What should I pack for the walking week?",
         "Which village would you stay longest in?", "How do I get back to the airport at the end?"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", nargs="+", default=["stage_configs/smollm2_chain.yaml",
                                                    "stage_configs/qwen2_5_omni_small.yaml"])
    p.add_argument("--backend", choices=["ray", "local"], help="override runtime.backend (default: the config's)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--turns", type=int, default=3, help=f"turns per conversation (1..{len(TURNS)})")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=4, help="rounds at concurrency 1 (modes alternating)")


def _summary(recs: list[dict[str, float]], wall_s: float) -> dict[str, Any]:
    ms = lambda key: [r[key] * 1000 for r in recs if key in r]  # noqa: E731
    out: dict[str, Any] = {"requests": len(recs), "requests_per_s": len(recs) / wall_s}
    for key in ("ttft", "ttfp", "e2e"):
        vals = ms(key)
        if vals:
            out[f"{key}_p50_ms"], out[f"{key}_p99_ms"] = percentile(vals, 50), percentile(vals, 99)
            out[f"{key}_mean_ms"] = statistics.mean(vals)
    return out


def _system(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You are travel agent number {i}. {NOTES}"}]


@dataclass(frozen=True, slots=True)
class _Stages:
    """The config's text stage (its reply is the text; max_tokens applies to it) and audio stage."""

    text: str
    audio: str | None

    @classmethod
    def of(cls, config: Any) -> "_Stages":
        text = next(s.name for s in config.stages if s.final_output == "text")
        return cls(text, next((s.name for s in config.stages if s.final_output == "audio"), None))


# ------------------------------------------------------------------ in-process
async def _turn_in_process(omni: Any, stages: _Stages, messages: list, audio: bool, max_tokens: int):
    """One turn on AsyncOmni itself: the pipeline the server serves, without the server."""
    t0, rec, text = time.perf_counter(), {}, ""
    # As the server runs a chat turn: a text-only reply runs only the stages the text needs.
    async for ev in omni.stream({"prompt": messages}, {stages.text: {"max_tokens": max_tokens}},
                                request_id=f"bench-{next(_IDS)}", output_modalities=None if audio else ["text"]):
        if isinstance(ev, StageDelta):
            if ev.stage == stages.text and ev.text and "ttft" not in rec:
                rec["ttft"] = time.perf_counter() - t0
            if ev.audio is not None and len(ev.audio) and "ttfp" not in rec:
                rec["ttfp"] = time.perf_counter() - t0
            continue
        if ev.error:  # a final StageOutput
            raise RuntimeError(f"stage {ev.stage}: {ev.error}")
        if ev.stage == stages.text:
            text = ev.text or ""
        if ev.stage == stages.audio and "ttfp" not in rec:  # a one-shot waveform: the audio comes with the output
            rec["ttfp"] = time.perf_counter() - t0
    rec["e2e"] = time.perf_counter() - t0
    return text, rec


# ------------------------------------------------------------------------ http
async def _turn_http(client: Any, model: str, messages: list, audio: bool, max_tokens: int):
    extra = {"modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"}} if audio else {}
    t0, rec, text = time.perf_counter(), {}, ""
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  stream=True, **extra)
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            text += delta.content
            rec.setdefault("ttft", time.perf_counter() - t0)
        if getattr(delta, "audio", None) is not None:
            rec.setdefault("ttfp", time.perf_counter() - t0)
    rec["e2e"] = time.perf_counter() - t0
    return text, rec


async def _workload(turn, concurrency: int, turns: int, offset: int) -> tuple[list[dict[str, float]], float]:
    """`concurrency` conversations at once; `turn(messages) -> (reply, record)`. (records, wall seconds)"""
    recs: list[dict[str, float]] = []

    async def conversation(i: int) -> None:
        conv = Conversation(messages=_system(offset + i))
        for _, prompt in conv.turns(TURNS[:turns]):
            reply, rec = await turn(prompt)
            recs.append(rec)
            conv.answer(reply)

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(i) for i in range(concurrency)))
    return recs, time.perf_counter() - t0


async def _compare(config: Any, url: str, args: Any, audio: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both modes, interleaved per concurrency (in-process, then http) so that a change of machine load
    during the run hits both alike. Each has its own pipeline (the server's is in its process)."""
    import openai

    from omni import AsyncOmni

    omni = await AsyncOmni.create(config, backend=args.backend)
    try:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600) as client:
            stages = _Stages.of(config)
            modes = {
                "in_process": lambda m: _turn_in_process(omni, stages, m, audio, args.max_tokens),
                "http": lambda m: _turn_http(client, config.name, m, audio, args.max_tokens),
            }
            out: dict[str, dict[str, Any]] = {mode: {} for mode in modes}
            for turn in modes.values():
                await _workload(turn, 1, 1, offset=10_000)  # warm-up: one-time costs out of the timing
            offset = 0
            for c in args.concurrency:
                recs: dict[str, list] = {mode: [] for mode in modes}
                wall = dict.fromkeys(modes, 0.0)
                for _ in range(args.repeats if c == 1 else 1):  # concurrency 1: few requests, so more rounds
                    for mode, turn in modes.items():
                        r, w = await _workload(turn, c, args.turns, offset)
                        recs[mode] += r
                        wall[mode] += w
                    offset += c
                for mode in modes:
                    out[mode][f"c{c}"] = _summary(recs[mode], wall[mode])
            return out["in_process"], out["http"]
    finally:
        await omni.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from omni.config.loader import load_config

    if not 1 <= args.turns <= len(TURNS):
        raise ValueError(f"--turns must be in 1..{len(TURNS)}, got {args.turns}")
    load = os.getloadavg()
    result: dict[str, Any] = {"concurrency": args.concurrency, "turns": args.turns, "max_tokens": args.max_tokens,
                              "loadavg_before": [round(x, 2) for x in load], "configs": {}}
    for i, path in enumerate(args.configs):
        cfg = load_config(path)
        audio = any(s.final_output == "audio" for s in cfg.stages)
        server_args = ["--port", "0", "--log-level", "warning", *(["--backend", args.backend] if args.backend else [])]
        with serve_process(path, *server_args, env={**os.environ, "OMNI_API_KEY": ""}) as srv:
            local, http = asyncio.run(_compare(cfg, srv.url, args, audio))
        for c in args.concurrency:
            a, b = local[f"c{c}"], http[f"c{c}"]
            print(f"{cfg.name} c={c}: in-process {a['requests_per_s']:.2f} req/s, e2e {a['e2e_mean_ms']:.0f} ms; "
                  f"http {b['requests_per_s']:.2f} req/s, e2e {b['e2e_mean_ms']:.0f} ms, "
                  f"ttft p99 {b.get('ttft_p99_ms') or 0:.0f} ms", flush=True)
        first = min(args.concurrency)
        entry = {"audio": audio, "in_process": local, "http": http,
                 "http_overhead_ratio": http[f"c{first}"]["e2e_mean_ms"] / local[f"c{first}"]["e2e_mean_ms"]}
        result["configs"][cfg.name] = entry
        prefix = "" if i == 0 else "omni_" if audio else f"{cfg.name}_"
        top = max(args.concurrency)
        result[f"{prefix}http_overhead_ratio"] = entry["http_overhead_ratio"]
        result[f"{prefix}ttft_p99_ms_c{top}"] = http[f"c{top}"].get("ttft_p99_ms")
        result[f"{prefix}requests_per_s_c{top}"] = http[f"c{top}"]["requests_per_s"]
        if audio:
            result[f"{prefix}ttfp_p99_ms_c{top}"] = http[f"c{top}"].get("ttfp_p99_ms")
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result
