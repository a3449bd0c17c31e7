"""`omni run --stream` where the audio streams (Qwen2.5-Omni with streaming edges, as in
stage_configs/qwen2_5_omni_small.yaml): the CLI appends each audio chunk to a WAV file as it arrives.
The file must open with `wave`, hold exactly the samples the pipeline streamed (in order, as pcm16),
and agree with the final waveform; `--json` still ends stdout with the results, exit code 0.

Runs in this process on the tiny checkpoint (qwen2_5_omni_tiny.yaml with the small config's edges),
local backend, a few tokens per stage."""
from __future__ import annotations

import json
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from omni import cli
from omni.cli.run_outputs import DEFAULT_SAMPLE_RATE
from omni.serve.audio.codecs import to_pcm16

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "stage_configs" / "qwen2_5_omni_tiny.yaml"
SMALL = REPO / "stage_configs" / "qwen2_5_omni_small.yaml"
MAX_TOKENS = 16
# token2wav's chunks made small (codec codes per chunk) so that a 16-token reply comes in several
CHUNKS = {"token2wav": {"model_kwargs": {"first_chunk_codes": 4, "chunk_codes": 4}}}


def streaming_edges(config: Path) -> dict[str, dict[str, Any]]:
    """The config's streaming edges as stage overrides (read from the file, so that they follow it)."""
    stages = yaml.safe_load(config.read_text())["stages"]
    edges = {s["name"]: {"inputs": s["inputs"]} for s in stages
             if any(isinstance(i, dict) and i.get("stream") for i in s.get("inputs", []))}
    assert edges, f"{config.name} has no streaming edge any more: pick a config whose audio streams"
    return edges


class AudioChunks:
    """Records the audio deltas `Omni.stream` yields (the CLI consumes the same iterator)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from omni.api import Omni

        self.chunks: dict[tuple[str, str], list[np.ndarray]] = {}
        self.rates: dict[tuple[str, str], int | None] = {}
        original = Omni.stream

        def stream(omni: Any, *args: Any, **kw: Any):
            for ev in original(omni, *args, **kw):
                audio = getattr(ev, "audio", None)
                if type(ev).__name__ == "StageDelta" and audio is not None and len(audio):
                    self.chunks.setdefault((ev.request_id, ev.stage), []).append(np.asarray(audio).copy())
                    self.rates[(ev.request_id, ev.stage)] = ev.sampling_rate
                yield ev

        monkeypatch.setattr(Omni, "stream", stream)


def read_wav(path: Path) -> tuple[wave._wave_params, bytes]:
    with wave.open(str(path), "rb") as w:
        return w.getparams(), w.readframes(w.getnframes())


def assert_streamed_wav(path: Path, chunks: list[np.ndarray], rate: int | None) -> bytes:
    """The WAV the CLI wrote while streaming: mono pcm16 at the stage's rate, exactly the chunks' samples."""
    assert path.is_file(), f"no streamed WAV at {path}"
    params, frames = read_wav(path)
    assert (params.nchannels, params.sampwidth) == (1, 2)
    assert params.framerate == (rate or DEFAULT_SAMPLE_RATE)
    assert params.nframes == sum(c.size for c in chunks) > 0
    assert frames == to_pcm16(np.concatenate(chunks))
    return frames


@pytest.mark.timeout(300)
def test_streamed_audio_goes_to_a_wav_as_it_arrives(tmp_path, capsys, monkeypatch):
    spy = AudioChunks(monkeypatch)
    out_dir = tmp_path / "out"
    overrides = streaming_edges(SMALL)
    overrides["token2wav"] = {**overrides["token2wav"], **CHUNKS["token2wav"]}
    rc = cli.main(["run", str(TINY), "--prompt", "Hello, how are you?", "--stream", "--json", "--backend", "local",
                   "--max-tokens", str(MAX_TOKENS), "--output-dir", str(out_dir),
                   "--stage-overrides", json.dumps(overrides)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    data = json.loads(captured.out.strip().splitlines()[-1])  # --json: stdout ends with the results
    [result] = data["results"]
    assert result["error"] is None
    assert "thinker: " in captured.err  # with --json the streamed text goes to stderr

    [(key, chunks)] = spy.chunks.items()
    assert key == (result["request_id"], "token2wav")
    assert len(chunks) >= 2, "the audio did not come in chunks: nothing was appended"
    frames = assert_streamed_wav(out_dir / "0000_token2wav.stream.wav", chunks, spy.rates[key])
    # the chunks are the final waveform: the same samples as the final output's WAV
    assert result["outputs"]["token2wav"]["audio_samples"] == len(frames) // 2
    assert read_wav(out_dir / "0000_token2wav.wav")[1] == frames


@pytest.mark.timeout(300)
def test_run_without_output_dir_writes_the_audio_and_says_where(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["run", str(TINY), "--prompt", "Hello, how are you?", "--backend", "local",
                   "--max-tokens", str(MAX_TOKENS)])
    out = capsys.readouterr().out
    assert rc == 0
    wav = Path("omni_outputs") / "0000_token2wav.wav"
    params, _ = read_wav(tmp_path / wav)
    assert f"  token2wav (audio): {params.nframes} samples -> {wav}\n" in out, out
    assert "audio written to ./omni_outputs/ (--output-dir DIR to choose where)" in out
