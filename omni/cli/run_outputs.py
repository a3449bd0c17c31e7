"""What `omni run` writes: a stage output's record (results.jsonl, --json), its audio as WAV files, and
--output-dir's text and hidden-state files.

Audio is always written somewhere and the place printed: --output-dir, else DEFAULT_AUDIO_DIR under the
current directory (as vLLM-Omni's offline examples write their WAVs to a folder by default), one file per
prompt and audio stage: `{prompt index:04d}_{stage}.wav` (`.stream.wav` while --stream appends its chunks).
"""
from __future__ import annotations

import wave
from pathlib import Path
from typing import Any

import numpy as np

from omni.cli.jsonable import dumps

DEFAULT_SAMPLE_RATE = 24000  # Qwen2.5-Omni's token2wav rate, when a stage does not say
DEFAULT_AUDIO_DIR = Path("omni_outputs")


def wav_path(audio_dir: Path, index: int, stage: str, streamed: bool = False) -> Path:
    return audio_dir / f"{index:04d}_{stage}{'.stream' if streamed else ''}.wav"


def sample_rate(stage_output: Any) -> int:
    return int(stage_output.passthrough.get("sampling_rate", DEFAULT_SAMPLE_RATE))


def stage_record(out: Any, audio_file: Path | None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
        "num_prompt_tokens": len(out.prompt_token_ids), "num_cached_tokens": out.num_cached_tokens,
        "metrics": out.metrics,
    }
    if out.audio is not None:
        rec["audio_samples"] = int(np.asarray(out.audio).size)
        if audio_file is not None:
            rec["audio_file"] = str(audio_file)
    if out.hidden_states is not None:
        rec["hidden_states_shape"] = list(np.asarray(out.hidden_states).shape)
    return rec


def write_wavs(audio_dir: Path, outputs: list[Any]) -> dict[tuple[int, str], Path]:
    """Every stage output's audio as one WAV; {(prompt index, stage): its file}."""
    from omni.serve.audio.codecs import encode_wav

    written = {}
    for i, ro in enumerate(outputs):
        for stage, so in ro.outputs.items():
            if so.audio is not None:
                path = wav_path(audio_dir, i, stage)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(encode_wav(so.audio, sample_rate(so)))
                written[(i, stage)] = path
    return written


def append_audio(wavs: dict[tuple[str, str], Any], key: tuple[str, str], path: Path, audio: Any,
                 rate: int | None) -> None:
    """Append one chunk to the WAV streamed at `path` (opened on the first chunk; the header is completed
    when the caller closes it)."""
    if key not in wavs:
        path.parent.mkdir(parents=True, exist_ok=True)
        w = wave.open(str(path), "wb")
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate or DEFAULT_SAMPLE_RATE))
        wavs[key] = w
    pcm = (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767).astype("<i2")
    wavs[key].writeframes(pcm.tobytes())


def write_outputs(out_dir: Path, results: list[dict[str, Any]], outputs: list[Any]) -> None:
    """--output-dir: results.jsonl and each stage's text and hidden states (its audio: write_wavs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.jsonl", "w") as f:
        for rec in results:
            f.write(dumps(rec) + "\n")
    for i, ro in enumerate(outputs):
        for stage, so in ro.outputs.items():
            stem = out_dir / f"{i:04d}_{stage}"
            if so.text is not None:
                stem.with_suffix(".txt").write_text(so.text)
            if so.hidden_states is not None:
                np.save(stem.with_suffix(".npy"), np.asarray(so.hidden_states))
