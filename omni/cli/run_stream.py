"""`omni run --stream`: each stage's text printed as it is generated, audio appended to a WAV as its chunks
arrive."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omni.cli.run_outputs import DEFAULT_SAMPLE_RATE, append_audio, wav_path
from omni.cli.run_prompts import prompt_of


def run_streaming(omni: Any, prompts: list[Any], sampling: Any, out: Any,
                  audio_dir: Path) -> tuple[list[Any], dict[tuple[int, str], Path]]:
    """Stream every prompt, printing text deltas as they arrive and appending audio chunks to WAV
    files (`{i:04d}_{stage}.stream.wav`); the RequestOutputs, in prompt order, and the WAVs written
    ({(prompt index, stage): file}).

    One prompt: each stage's text is written as it grows. Several: one line per delta,
    prefixed "[i stage]" (they interleave as the requests run concurrently)."""
    from omni.messages import RequestOutput

    order: list[str] = []
    results: dict[str, RequestOutput] = {}
    current: tuple[str, str] | None = None
    wavs: dict[tuple[str, str], Any] = {}
    try:
        for ev in omni.stream(prompts, sampling):
            current = _on_stream_event(ev, prompts, order, results, current, wavs, out, audio_dir)
    finally:
        for w in wavs.values():
            w.close()
    if current:
        out.write("\n")
    written = {(order.index(rid), stage): wav_path(audio_dir, order.index(rid), stage, streamed=True)
               for rid, stage in wavs}
    return [results[r] for r in order], written


def _on_stream_event(ev: Any, prompts: list[Any], order: list[str], results: dict[str, Any],
                     current: tuple[str, str] | None, wavs: dict[tuple[str, str], Any], out: Any,
                     audio_dir: Path) -> tuple[str, str] | None:
    """Handle one streamed item; returns the (request, stage) whose text is being written inline."""
    from omni.messages import RequestOutput, StageDelta

    rid = ev.request_id
    if rid not in results:
        order.append(rid)
        results[rid] = RequestOutput(rid, prompt_of(prompts[len(order) - 1]) if len(order) <= len(prompts) else None)
    i = order.index(rid)
    if not isinstance(ev, StageDelta):
        if ev.error:
            results[rid].error = ev.error
        else:
            results[rid].outputs[ev.stage] = ev
            if ev.audio is not None and len(ev.audio) and (rid, ev.stage) not in wavs:
                # audio that came whole, not in chunks (a stage behind a plain edge, a reply shorter than
                # one chunk): the same file, written once
                rate = ev.passthrough.get("sampling_rate", DEFAULT_SAMPLE_RATE)
                append_audio(wavs, (rid, ev.stage), wav_path(audio_dir, i, ev.stage, streamed=True), ev.audio, rate)
        return current
    if ev.audio is not None and len(ev.audio):
        append_audio(wavs, (rid, ev.stage), wav_path(audio_dir, i, ev.stage, streamed=True), ev.audio,
                     ev.sampling_rate)
    if not ev.text:
        return current
    if len(prompts) == 1:
        if current != (rid, ev.stage):
            out.write(("\n" if current else "") + f"{ev.stage}: ")
            current = (rid, ev.stage)
        out.write(ev.text)
    else:
        out.write(f"[{i} {ev.stage}] {ev.text!r}\n")
    out.flush()
    return current
