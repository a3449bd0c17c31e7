"""The omni half of `omni bench streaming`: time to first audio and real-time factor.

The small random Qwen2.5-Omni (`--pipeline omni`, stage_configs/qwen2_5_omni_small.yaml: thinker ~> talker ~>
token2wav, ~95 M parameters) or Qwen3-Omni (`--pipeline qwen3-omni`, stage_configs/qwen3_omni_small.yaml:
thinker ~> talker ~> code2wav, ~120 M parameters; the three stages found from the config, audio_chain.py)
on the Ray backend, with its streaming edges vs the same pipeline with plain edges, one run:

- concurrency 1 (--omni-repeats requests in a row) and 4 (distinct prompts, submitted together): per
  request TTFP (submission -> the first audio samples: the first token2wav delta when streaming, the
  finished waveform otherwise), end to end, and RTF = end to end / seconds of audio. Every reply has
  --omni-audio-codes talker tokens (the talker's min_tokens = max_tokens; by default 5 s of audio: 250
  Qwen2.5-Omni codec tokens, 63 Qwen3-Omni frames): a random checkpoint's replies end at random, and
  streaming gains with the length of the reply;
- a multi-turn conversation (turn 1: a long message, an image and an audio clip, the image only for
  Qwen3-Omni whose talker refuses both in one conversation; later turns resend
  the conversation) for each of streaming on/off x prefix caching on/off: TTFP per turn (`--plot`
  draws it).

Keys: ttfp_speedup (non-streaming / streaming TTFP, concurrency 1; target >= 5, >= 8 for Qwen3-Omni), rtf_streaming
(< 1: faster than real time), stall_s_streaming (mean seconds of silence a listener playing each chunk as it
arrives hears after the first: 0 when every chunk comes before the audio queued ahead of it runs out),
e2e_ratio (streaming / non-streaming end to end; target <= 1.10), the same with _c4, and ttfp_per_turn.
"""
from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from omni.bench.audio_chain import AudioChain, audio_chain

TOPICS = ["the sea", "a lighthouse", "the mountains", "a city at night", "an old library", "a rainy day",
           "the desert", "a forest in autumn"]


# --omni-audio-codes by default: 5 s of audio (Qwen2.5-Omni: 50 codec tokens a second; Qwen3-Omni: 12.5 frames)
DEFAULT_AUDIO_CODES = {"omni": 250, "qwen3-omni": 63}
DEFAULT_CONFIG = {"omni": "stage_configs/qwen2_5_omni_small.yaml", "qwen3-omni": "stage_configs/qwen3_omni_small.yaml"}


def omni_overrides(chain: AudioChain, streaming: bool, caching: bool, audio_codes: int) -> dict[str, Any]:
    ov: dict[str, Any] = {} if streaming else chain.plain_edges()
    for stage in (chain.thinker, chain.talker):
        ov.setdefault(stage, {})["enable_prefix_caching"] = caching
    if audio_codes:
        # Every reply the same length (min_tokens = max_tokens masks the codec eos): a random checkpoint
        # stops at random, and a TTFP ratio means little unless both modes make the same audio.
        ov[chain.talker]["sampling"] = {"max_tokens": audio_codes, "min_tokens": audio_codes}
    return ov


def _run(omni, chain: AudioChain, prompts: list[Any]) -> list[dict[str, float]]:
    """Submit all prompts at once; per request: ttfp, e2e, audio seconds, rtf (audio_times)."""
    from omni.bench.workloads import stream_timed

    return audio_times(stream_timed(omni, prompts), chain.audio)


def audio_times(records: list[Any], audio_stage: str) -> list[dict[str, float]]:
    """Per timed request (workloads.TimedRequest) of the omni pipeline: ttfp (the first audio samples: a
    delta of `audio_stage` when streaming, the finished waveform otherwise), e2e, audio seconds, rtf. A failed
    request raises, naming the stage. stall_s: the silence a listener playing the chunks as they come hears
    after the first one (workloads.playback_stall_s; 0 for a one-shot waveform)."""
    from omni.bench.workloads import playback_stall_s

    out = []
    for r in records:
        if r.error:
            raise RuntimeError(f"request {r.request_id} failed at stage {r.error_stage}: {r.error}")
        wav, e2e = r.outputs[audio_stage], r.output_s[audio_stage]
        audio_s = len(wav.audio) / int(wav.passthrough.get("sampling_rate", 24000))
        out.append({"ttfp_s": r.first_audio_at(audio_stage), "e2e_s": e2e, "audio_s": audio_s,
                    "rtf": e2e / max(audio_s, 1e-9), "stall_s": playback_stall_s(r.audio_deltas)})
    return out


def _conversation_ttfps(omni, chain: AudioChain, tokenizer, args) -> list[float]:
    """TTFP per turn of one conversation (turn 1 carries a long document, an image and audio: AudioChain.media)."""
    from omni.bench.workloads import Conversation, long_document, with_media

    mm = chain.media(np.random.default_rng(args.seed))
    doc = long_document(tokenizer, args.omni_doc_tokens, args.seed)
    conv = Conversation(messages=[])
    ttfp = []
    questions = (with_media(mm, f"{doc}\nPlease describe the picture and the sound, then the table.") if turn == 0
                 else f"Thank you. Tell me more, part {turn}." for turn in range(args.omni_turns))
    for turn, prompt in conv.turns(questions):
        [r] = _run(omni, chain, [{"prompt": prompt, "multi_modal_data": mm}])
        ttfp.append(r["ttfp_s"])
        conv.answer(f"Reply {turn}.")
    return ttfp


def run_omni(args) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from omni import Omni
    from omni.config.loader import load_config
    from omni.registry import resolve_model_path

    config = args.omni_config or DEFAULT_CONFIG[_pipeline(args)]
    codes = DEFAULT_AUDIO_CODES[_pipeline(args)] if args.omni_audio_codes is None else args.omni_audio_codes
    cfg = load_config(config)
    chain = audio_chain(cfg)
    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.stage(chain.thinker).model_path)))
    conc: dict[bool, dict[int, list[dict[str, float]]]] = {}
    turns: dict[str, list[float]] = {}
    for streaming in (False, True):
        for caching in (True, False):
            with Omni(config, backend=args.backend,
                      stage_overrides=omni_overrides(chain, streaming, caching, codes)) as o:
                _run(o, chain, ["Warm up, please."])  # one-time costs out of the timing
                if caching:  # distinct prompts: no prefix hits in the concurrency runs
                    conc[streaming] = {}
                    for c in args.concurrency:
                        # concurrency 1: --omni-repeats requests one after the other (one is too noisy)
                        rounds = args.omni_repeats if c == 1 else 1
                        conc[streaming][c] = [r for k in range(rounds) for r in _run(o, chain, [
                            f"Tell me a story about {TOPICS[(i + c + k) % len(TOPICS)]}, number {c}-{i}-{k}."
                            for i in range(c)])]
                key = f"{'streaming' if streaming else 'non_streaming'}_caching_{'on' if caching else 'off'}"
                turns[key] = _conversation_ttfps(o, chain, tok, args)
                print(f"omni {key}: TTFP per turn {[round(t, 2) for t in turns[key]]}", flush=True)

    def mean(streaming: bool, c: int, key: str) -> float:
        return statistics.mean(r[key] for r in conc[streaming][c])

    result: dict[str, Any] = {"omni_config": config, "omni_stages": chain.names, "omni_turns": args.omni_turns,
                              "omni_audio_codes": codes, "omni_media": sorted(chain.media(np.random.default_rng(0))),
                              "ttfp_per_turn": turns}
    for c in args.concurrency:
        sfx = "" if c == 1 else f"_c{c}"
        result[f"omni_c{c}"] = {mode: {**{k: mean(s, c, k) for k in ("ttfp_s", "e2e_s", "audio_s", "rtf", "stall_s")},
                                       "ttfp_s_each": [r["ttfp_s"] for r in conc[s][c]]}
                                for mode, s in (("non_streaming", False), ("streaming", True))}
        result[f"ttfp_speedup{sfx}"] = mean(False, c, "ttfp_s") / mean(True, c, "ttfp_s")
        result[f"rtf_streaming{sfx}"] = mean(True, c, "rtf")
        result[f"stall_s_streaming{sfx}"] = mean(True, c, "stall_s")
        result[f"e2e_ratio{sfx}"] = mean(True, c, "e2e_s") / mean(False, c, "e2e_s")
        print(f"omni c={c}: TTFP {mean(False, c, 'ttfp_s'):.2f}s -> {mean(True, c, 'ttfp_s'):.2f}s, "
              f"e2e {mean(False, c, 'e2e_s'):.2f}s -> {mean(True, c, 'e2e_s'):.2f}s, "
              f"RTF streaming {mean(True, c, 'rtf'):.2f}, playback stalls {mean(True, c, 'stall_s'):.2f}s", flush=True)
    if args.plot:
        result["plot"] = plot_ttfp(turns, args.plot, cfg.name)
    return result


def _pipeline(args) -> str:
    """`omni` (Qwen2.5-Omni) or `qwen3-omni`: the pipeline whose defaults apply (`both` runs Qwen2.5-Omni's)."""
    return "qwen3-omni" if getattr(args, "pipeline", "omni") == "qwen3-omni" else "omni"


def plot_ttfp(turns: dict[str, list[float]], path: str, name: str = "small Qwen2.5-Omni") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for key, ys in sorted(turns.items()):
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=key.replace("_", " "))
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first audio (s)")
    ax.set_yscale("log")
    ax.set_xticks(range(1, max(len(v) for v in turns.values()) + 1))
    ax.set_title(f"{name}: TTFP per turn")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
