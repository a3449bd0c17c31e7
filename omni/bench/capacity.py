"""`omni bench capacity`: audio seconds per second as concurrency grows, Ray vs local, omni vs transformers.

The small Qwen2.5-Omni (stage_configs/qwen2_5_omni_small.yaml: thinker ~> talker ~> token2wav, streamed),
every reply the same length (the thinker's `--thinker-tokens` and the talker's `--reply-seconds` x 50 codec
tokens, min_tokens = max_tokens: every mode does the same work), one run:

1. Ray backend, closed loop at each `--concurrency` C: C clients share `--requests` distinct prompts, each
   sending its next one when its last reply ends (AsyncOmni.stream). Per level: audio_s_per_s (audio seconds
   produced / wall seconds), TTFP (submission -> first audio samples) p50/p99 in ms, RTF (end to end / audio
   seconds) p50/p99, playback stalls (stall_p50_ms / stall_p99_ms: the silence a listener playing each chunk
   as it arrives hears after the first, workloads.playback_stall_s), and each stage's time split (step_profile.py): stage_busy_fraction and forward /
   sampling / host / waiting fractions of the level's wall time (of a replicated stage: of its replicas x
   the wall time, the mean replica's); vocoder_busy_fraction: the same for token2wav's vocoder thread
   (model_kwargs.vocoder_thread: the one-shot engine's finish thread), whose work is outside the stage's steps.
2. The concurrency-1 requests again on the local backend: ray_over_local_e2e_c1 (mean end to end, Ray / local).
3. The same requests through transformers' Qwen2_5OmniForConditionalGeneration.generate (greedy, with audio),
   one after another, in this process with this machine's cores (references/qwen2_5_omni.py):
   vs_hf_audio_s_per_s_c4 (omni at concurrency 4 over transformers), vs_hf_ttfp_c1 (transformers' time to
   its waveform / omni's TTFP, p50), and audio_identical: 1 when, for every request, omni's thinker tokens and codec tokens equal
   transformers' and the waveforms agree, on the local backend (audio_identical_ray: the same on Ray; and
   hf.{local,ray}.codes_first_difference, per request). Why both: the talker takes the thinker's rows as
   they stream in, so on Ray how its prompt is cut into forward passes follows the actors' timing; fp32
   sums cut differently differ in the last bits, and where two codec logits nearly tie, a greedy code
   late in a long reply can flip. The local backend steps the stages in a fixed order. The waveform omni
   streams is made in chunked DiT windows (one block of context each side): the same math in other shapes,
   so equal to the one-shot waveform up to the blocking of fp32 sums (README's table has the SNRs);
   "agree" is an SNR >= 100 dB, and
   audio_bitwise_equal says whether they are bit for bit equal.

`--stage-overrides` changes the pipeline on both backends (the JSON's `stage_overrides` echoes it): the
bottleneck stage scaled out with `'{"token2wav": {"replicas": 2}}'` (README: what bounds capacity).

The machine's own limit beside each level (machine_cpu.py, Linux): machine_cpu_busy (all CPUs' time not
idle over the level), core_s_per_audio_s (what an audio second cost in core-seconds: the driver and Ray's
daemons included) and audio_s_per_s_cpu_ceiling (the rate that cost allows with every core busy); the
same for transformers' run (hf.*). throughput_c4_over_c1_cpu_ceiling = concurrency 4's ceiling over
concurrency 1's rate: the most throughput_c4_over_c1 could be here at concurrency 4's cost per audio
second.

`--rates R ...` adds an open loop on Ray after the closed levels: at each rate, `--requests` prompts arrive
as a seeded Poisson process of R requests a second, each sent whatever is still running (what live users
do; a closed loop's equal replies end together, so its clients arrive together). Per rate, under
"open_loop": the same level stats, rate_per_s, offered_audio_s_per_s (what the arrivals ask for) and
arrival_span_s.

Also throughput_c4_over_c1 (audio_s_per_s) and ttfp_p99_c4_over_c1_p50. `--plot PNG` draws audio s/s and
TTFP p99 against concurrency (transformers' audio s/s as a line).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import time
from typing import Any

import numpy as np

from omni.bench.measures import AGREE_SNR_DB, percentile, snr_db

CODES_PER_SECOND = 50  # Qwen2.5-Omni's talker: 50 codec tokens per second of audio


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="stage_configs/qwen2_5_omni_small.yaml")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="closed-loop clients per level (1 is always run: the c1 keys need it)")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level (fixed total)")
    p.add_argument("--reply-seconds", type=float, default=5.0, help="audio seconds of every reply")
    p.add_argument("--thinker-tokens", type=int, default=32, help="text tokens of every reply")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="PNG", help="draw audio s/s and TTFP p99 vs concurrency")
    p.add_argument("--rates", type=float, nargs="*", default=[], metavar="REQ_PER_S",
                   help="also an open loop at each rate: --requests prompts arriving as a Poisson process of this "
                        "many requests a second, each sent whatever is still running (Ray backend)")
    p.add_argument("--stage-overrides", metavar="JSON", default=None,
                   help='per-stage overrides over the benchmark\'s own, e.g. \'{"token2wav": {"replicas": 2}}\' '
                        "(both backends)")


def _overrides(args) -> dict[str, Any]:
    from omni.config.loader import merge_stage_overrides, parse_stage_overrides

    from omni.bench.audio_chain import audio_chain
    from omni.bench.omni_streaming import omni_overrides

    ov = omni_overrides(audio_chain(args.config), streaming=True, caching=True, audio_codes=_codes(args))
    n = args.thinker_tokens
    ov["thinker"]["sampling"] = {"temperature": 0.0, "max_tokens": n, "min_tokens": n}
    return merge_stage_overrides(ov, parse_stage_overrides(args.stage_overrides))


def _codes(args) -> int:
    return max(1, round(args.reply_seconds * CODES_PER_SECOND))


def _prompts(tok, n: int, tag: str) -> list[list[int]]:
    from omni.bench.omni_streaming import TOPICS

    return [tok(f"Tell me a story about {TOPICS[i % len(TOPICS)]}, number {tag}-{i}.")["input_ids"]
            for i in range(n)]


def _level(times: list[dict[str, float]], wall_s: float) -> dict[str, Any]:
    ttfp = [t["ttfp_s"] * 1000 for t in times]
    rtf = [t["rtf"] for t in times]
    stall = [t["stall_s"] * 1000 for t in times]  # silence a listener hears after the first chunk
    audio = sum(t["audio_s"] for t in times)
    return {"requests": len(times), "wall_s": wall_s, "audio_s": audio, "audio_s_per_s": audio / wall_s,
            "ttfp_p50_ms": percentile(ttfp, 50), "ttfp_p99_ms": percentile(ttfp, 99), "rtf_p50": percentile(rtf, 50),
            "rtf_p99": percentile(rtf, 99), "stall_p50_ms": percentile(stall, 50),
            "stall_p99_ms": percentile(stall, 99),
            "e2e_mean_s": float(np.mean([t["e2e_s"] for t in times]))}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _cpu_keys(cpu: Any, wall_s: float, audio_s: float) -> dict[str, Any]:
    """The whole machine's CPU over a level: how busy, what an audio second cost in core-seconds, and the
    audio seconds per second that cost would allow with every core busy (None off Linux)."""
    if cpu.busy is None or audio_s <= 0:
        return {"machine_cpu_busy": None, "cores": cpu.cores, "core_s_per_audio_s": None,
                "audio_s_per_s_cpu_ceiling": None}
    cost = cpu.busy * cpu.cores * wall_s / audio_s
    return {"machine_cpu_busy": cpu.busy, "cores": cpu.cores, "core_s_per_audio_s": cost,
            "audio_s_per_s_cpu_ceiling": cpu.cores / cost if cost > 0 else None}


async def _sweep(args, backend: str, levels: dict[int, list[list[int]]],
                 rates: dict[float, list[list[int]]] | None = None) -> tuple[dict[int, Any], list[Any], dict]:
    """Every level on one pipeline: {C: level stats with the stages' time split}, the c1 records, and
    {rate: the open loop's level stats} for `rates` (requests a second -> its prompts)."""
    from omni import AsyncOmni
    from omni.engine.step_profile import PHASES, window

    from omni.bench.machine_cpu import MachineCPU

    from omni.bench.omni_streaming import audio_times
    from omni.bench.workloads import closed_loop_timed, open_loop_timed, poisson_arrivals

    async def measure(o: Any, label: str, load) -> tuple[dict[str, Any], list[Any]]:
        before = (await o.stats())["stages"]
        with MachineCPU() as cpu:
            recs, wall = await load
        after = (await o.stats())["stages"]
        lv = _level(audio_times(recs, "token2wav"), wall)
        lv.update(_cpu_keys(cpu, wall, lv["audio_s"]))
        # A replicated stage's counters are replica-seconds (replica_stats.py): its fractions are of its
        # replicas x the wall time, the mean replica's.
        split = {s: window(before[s], after[s], wall * max(1, len(after[s].get("replicas") or ())))
                 for s in after}
        lv["stage_busy_fraction"] = {s: w["stage_busy_fraction"] for s, w in split.items()}
        lv["stage_profile"] = {s: {p: w[p] for p in PHASES} for s, w in split.items()}
        lv["torch_threads"] = {s: after[s].get("torch_threads") for s in after}
        # A one-shot engine's finish thread beside its steps (token2wav's vocoder): its busy fraction apart.
        lv["vocoder_busy_fraction"] = {
            s: (after[s]["finish_thread_time_s"] - (before[s].get("finish_thread_time_s") or 0.0))
            / (wall * max(1, len(after[s].get("replicas") or ())))
            for s in after if after[s].get("finish_thread_time_s") is not None}
        print(f"{backend} {label}: {lv['audio_s_per_s']:.3f} audio-s/s, TTFP p50 {lv['ttfp_p50_ms']:.0f} ms "
              f"p99 {lv['ttfp_p99_ms']:.0f} ms, RTF p50 {lv['rtf_p50']:.2f}, stalls p50 "
              f"{lv['stall_p50_ms']:.0f} ms, machine CPU {_fmt(lv['machine_cpu_busy'])} busy, busy "
              f"{ {s: round(f, 2) for s, f in lv['stage_busy_fraction'].items()} }, vocoder thread busy "
              f"{ {s: round(f, 2) for s, f in lv['vocoder_busy_fraction'].items()} }", flush=True)
        return lv, recs

    out: dict[int, Any] = {}
    c1: list[Any] = []
    open_loop: dict[str, Any] = {}
    async with await AsyncOmni.create(args.config, stage_overrides=_overrides(args), backend=backend) as o:
        await closed_loop_timed(o, [{"prompt": "Warm up, please."}], 1, id_prefix="warm")  # one-time costs
        for c, prompts in levels.items():
            out[c], recs = await measure(o, f"c={c}", closed_loop_timed(
                o, [{"prompt_token_ids": p} for p in prompts], c, id_prefix=f"c{c}-"))
            if c == 1:
                c1 = recs
        for rate, prompts in (rates or {}).items():
            arrivals = poisson_arrivals(len(prompts), rate, args.seed)
            lv, _ = await measure(o, f"rate={rate:g}/s", open_loop_timed(
                o, [{"prompt_token_ids": p} for p in prompts], arrivals, id_prefix=f"r{rate:g}-"))
            # What the arrivals asked for, in audio seconds a second: against the closed loop's rates, whether
            # this rate loads the machine lightly or past what it can make.
            lv["rate_per_s"] = rate
            lv["offered_audio_s_per_s"] = rate * lv["audio_s"] / lv["requests"]
            lv["arrival_span_s"] = arrivals[-1]
            open_loop[f"{rate:g}"] = lv
    return out, c1, open_loop


def hf_device(cfg: Any, stage: str) -> str:
    """The device transformers' reference runs on: the one the pipeline's `stage` runs on (its `device`, "auto"
    resolved as the stage resolves it), so that a GPU pipeline is compared with transformers on that GPU."""
    from omni.engine.loading import resolve_device

    return str(resolve_device(stage, cfg.stage(stage).device))


def _hf(args, path, prompts: list[list[int]], device: str) -> tuple[dict[str, Any], list[Any]]:
    """transformers one request after another on the c1 prompts: its timing, and its replies."""
    import torch

    from omni.pipeline.threads import available_cores

    from omni.bench.references import qwen2_5_omni as hf_omni
    from omni.bench.machine_cpu import MachineCPU

    model = hf_omni.load(path, device)
    threads = available_cores()  # what a user's process gets: this machine's cores
    torch.set_num_threads(threads)
    codes = _codes(args)
    hf_omni.reply(model, prompts[0], 2, 4, seed=args.seed)  # one-time costs out of the timing
    t0 = time.perf_counter()
    with MachineCPU() as cpu:
        replies = [hf_omni.reply(model, p, args.thinker_tokens, codes, seed=args.seed) for p in prompts]
    wall = time.perf_counter() - t0
    total = sum(r.seconds for r in replies)
    times = [r.seconds * 1000 for r in replies]
    audio = sum(r.audio_s for r in replies)
    return {"device": device, "threads": threads, "requests": len(replies), "audio_s": audio,
            "wall_s": total, "audio_s_per_s": audio / total,
            "ttfp_p50_ms": percentile(times, 50), "ttfp_p99_ms": percentile(times, 99),
            **_cpu_keys(cpu, wall, audio)}, replies


def _agreement(replies: list[Any], records: list[Any]) -> dict[str, Any]:
    """omni's c1 replies against transformers': tokens, codes (and where they first differ), waveforms."""
    tokens_same, codes_same, bitwise, snrs, first_diff = True, True, True, [], []
    for r, rec in zip(replies, records):
        wav, thinker = rec.outputs["token2wav"], rec.outputs["thinker"]
        tokens_same &= list(thinker.token_ids) == r.thinker_ids
        codes = list(wav.prompt_token_ids or [])
        codes_same &= codes == r.codes
        first_diff.append(next((i for i, (a, b) in enumerate(zip(codes, r.codes)) if a != b),
                               None if len(codes) == len(r.codes) else min(len(codes), len(r.codes))))
        got = np.asarray(wav.audio, dtype=np.float32)
        same_len = got.shape == r.audio.shape
        bitwise &= same_len and bool(np.array_equal(got, r.audio))
        snrs.append(snr_db(r.audio, got) if same_len else float("-inf"))
    return {"thinker_tokens_identical": int(tokens_same), "codes_identical": int(codes_same),
            "codes_first_difference": first_diff, "audio_bitwise_equal": int(bitwise),
            "audio_snr_db_min": min(snrs), "audio_identical": int(tokens_same and codes_same and min(snrs) >= AGREE_SNR_DB)}


def run(args) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from omni.config.loader import load_config, parse_stage_overrides
    from omni.registry import resolve_model_path

    if (args.requests < 1 or args.thinker_tokens < 2 or args.reply_seconds <= 0 or min(args.concurrency) < 1
            or not all(math.isfinite(r) and r > 0 for r in args.rates)):
        raise SystemExit("error: --requests >= 1, --thinker-tokens >= 2 (the talker starts on the thinker's "
                         "second token), --reply-seconds > 0, --concurrency >= 1 and finite --rates > 0 are needed")
    # The pipeline as it will run (the overrides checked: a bad one fails here, before any model loads).
    cfg = load_config(args.config, _overrides(args))
    path = resolve_model_path(cfg.stage("thinker").model_path)
    tok = AutoTokenizer.from_pretrained(str(path))
    levels = {c: _prompts(tok, args.requests, f"c{c}") for c in sorted({1, *args.concurrency})}
    rates = {r: _prompts(tok, args.requests, f"r{r:g}") for r in sorted(set(args.rates))}
    ray, ray_c1, open_loop = asyncio.run(_sweep(args, "ray", levels, rates))
    local, local_c1, _ = asyncio.run(_sweep(args, "local", {1: levels[1]}))
    hf, replies = _hf(args, path, levels[1], hf_device(cfg, "thinker"))
    hf["local"], hf["ray"] = _agreement(replies, local_c1), _agreement(replies, ray_c1)
    print(f"transformers: {hf['audio_s_per_s']:.3f} audio-s/s, {hf['ttfp_p50_ms']:.0f} ms per reply "
          f"({hf['threads']} threads); audio identical: local {hf['local']['audio_identical']} "
          f"(SNR {hf['local']['audio_snr_db_min']:.0f} dB), ray {hf['ray']['audio_identical']} "
          f"(SNR {hf['ray']['audio_snr_db_min']:.0f} dB; codes differ from {hf['ray']['codes_first_difference']})",
          flush=True)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    def at(c: int, key: str) -> float | None:
        return ray[c][key] if c in ray else None

    result: dict[str, Any] = {
        "bench": "capacity", "config": args.config, "stage_overrides": parse_stage_overrides(args.stage_overrides),
        "backend": "ray", "concurrency": list(ray),
        "requests_per_level": args.requests, "reply_seconds": args.reply_seconds, "codec_tokens": _codes(args),
        "thinker_tokens": args.thinker_tokens,
        **{key: {str(c): lv[key] for c, lv in ray.items()} for key in (
            "audio_s_per_s", "ttfp_p50_ms", "ttfp_p99_ms", "rtf_p50", "rtf_p99", "stall_p50_ms", "stall_p99_ms",
            "stage_busy_fraction", "vocoder_busy_fraction", "stage_profile", "machine_cpu_busy", "core_s_per_audio_s",
            "audio_s_per_s_cpu_ceiling")},
        "levels": {str(c): lv for c, lv in ray.items()},
        "open_loop": open_loop,
        "throughput_c4_over_c1": ratio(at(4, "audio_s_per_s"), at(1, "audio_s_per_s")),
        "ttfp_p99_c4_over_c1_p50": ratio(at(4, "ttfp_p99_ms"), at(1, "ttfp_p50_ms")),
        # The most throughput_c4_over_c1 could be on this machine at concurrency 4's cost per audio second,
        # every core busy: what bounds the ratio when it is short of 1.8.
        "throughput_c4_over_c1_cpu_ceiling": ratio(at(4, "audio_s_per_s_cpu_ceiling"), at(1, "audio_s_per_s")),
        "local_c1": local[1], "ray_over_local_e2e_c1": ratio(ray[1]["e2e_mean_s"], local[1]["e2e_mean_s"]),
        "hf": hf, "vs_hf_audio_s_per_s_c4": ratio(at(4, "audio_s_per_s"), hf["audio_s_per_s"]),
        "vs_hf_ttfp_c1": ratio(hf["ttfp_p50_ms"], ray[1]["ttfp_p50_ms"]),
        "audio_identical": hf["local"]["audio_identical"], "audio_identical_ray": hf["ray"]["audio_identical"],
    }
    if args.plot:
        result["plot"] = plot(ray, hf["audio_s_per_s"], args.plot)
    return result


def plot(levels: dict[int, dict[str, Any]], hf_audio_s_per_s: float, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = sorted(levels)
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot(cs, [levels[c]["audio_s_per_s"] for c in cs], marker="o", color="tab:blue", label="omni audio s/s")
    ax.axhline(hf_audio_s_per_s, color="tab:blue", linestyle="--", label="transformers audio s/s")
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel("audio seconds per second")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ttfp = ax.twinx()
    ttfp.plot(cs, [levels[c]["ttfp_p99_ms"] / 1000 for c in cs], marker="s", color="tab:red", label="TTFP p99")
    ttfp.set_ylabel("TTFP p99 (s)")
    lines = ax.get_legend_handles_labels()
    more = ttfp.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    ax.set_title("small Qwen2.5-Omni: capacity vs concurrency")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
