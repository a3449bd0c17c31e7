"""`omni run stage_configs/qwen3_omni_tiny.yaml --prompt ...` end to end (in this process, local backend): the
text and the WAV equal transformers' Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True) greedy on
the same tiny checkpoint, with prefix caching on and off; with a streaming talker -> code2wav edge the audio
comes in chunks (chunked_decode's windows, a small first one) and the WAV holds exactly those samples."""
from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from omni import cli
from omni.config.loader import load_config
from omni.pipeline.threads import local_threads
from tests.stages.qwen3_omni_utils import assert_same_audio, hf_generate, hf_model, torch_threads

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "stage_configs" / "qwen3_omni_tiny.yaml"
PROMPT = "Hello there, who are you? Tell me about the sea, the ships that sail on it and the stars above them at night."
NO_CACHING = {"thinker": {"enable_prefix_caching": False}, "talker": {"enable_prefix_caching": False}}
# The local backend runs the stages on this many torch threads; transformers' reference runs on as many, so
# that both sum in the same order and the waveforms can be compared bit for bit on any machine.
THREADS = local_threads(load_config(TINY).stages)


def _limits() -> tuple[int, int]:
    stages = {s["name"]: s for s in yaml.safe_load(TINY.read_text())["stages"]}
    return stages["thinker"]["sampling"]["max_tokens"], stages["talker"]["sampling"]["max_tokens"]


def _run(tmp: Path, capsys, *extra: str) -> tuple[dict, dict, bytes]:
    rc = cli.main(["run", str(TINY), "--prompt", PROMPT, "--prompt", PROMPT, "--json", "--backend", "local",
                   "--output-dir", str(tmp), *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    data = json.loads(captured.out.strip().splitlines()[-1])
    first, second = data["results"]
    assert first["error"] is None and second["error"] is None
    with wave.open(str(tmp / "0000_code2wav.wav"), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        frames = w.readframes(w.getnframes())
    with wave.open(str(tmp / "0001_code2wav.wav"), "rb") as w:
        assert w.readframes(w.getnframes()) == frames  # the same prompt again: the second one may hit the caches
    return first, second, frames


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_omni_run_matches_transformers_generate(tmp_path, capsys):
    thinker_max, talker_max = _limits()
    on, on_again, wav_on = _run(tmp_path / "on", capsys)
    off, off_again, wav_off = _run(tmp_path / "off", capsys, "--stage-overrides", json.dumps(NO_CACHING))
    assert on_again["outputs"]["thinker"]["num_cached_tokens"] > 0
    assert off_again["outputs"]["thinker"]["num_cached_tokens"] == 0
    assert on["outputs"]["thinker"]["token_ids"] == off["outputs"]["thinker"]["token_ids"]
    assert on["outputs"]["thinker"]["text"] == off["outputs"]["thinker"]["text"]
    assert wav_on == wav_off
    from transformers import AutoTokenizer

    from stages.qwen3_omni.inputs import render_chatml
    from tests.stages.qwen3_omni_utils import checkpoint

    tok = AutoTokenizer.from_pretrained(str(checkpoint("tiny")))
    ids = tok(render_chatml([{"role": "user", "content": PROMPT}], None))["input_ids"]
    ref_tokens, _, ref_wav = hf_generate("tiny", ids, thinker_max=thinker_max, talker_max=talker_max, threads=THREADS)
    assert on["outputs"]["thinker"]["token_ids"] == ref_tokens
    assert on["outputs"]["thinker"]["text"] == tok.decode(ref_tokens, skip_special_tokens=True)
    assert_same_audio(wav_on, ref_wav)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_omni_run_streams_code2wav_chunks(tmp_path, capsys):
    """code2wav on a streaming edge: chunks of 4 then 8 frames, each decoded with chunked_decode's left context."""
    thinker_max, talker_max = _limits()
    overrides = {"code2wav": {"inputs": [{"stage": "talker", "stream": True, "chunk_tokens": 3}],
                              "model_kwargs": {"first_chunk_frames": 4, "chunk_frames": 8, "left_context_frames": 25}}}
    out = tmp_path / "stream"
    rc = cli.main(["run", str(TINY), "--prompt", PROMPT, "--json", "--backend", "local", "--stream",
                   "--output-dir", str(out), "--stage-overrides", json.dumps(overrides)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    with wave.open(str(out / "0000_code2wav.stream.wav"), "rb") as w:
        streamed = w.readframes(w.getnframes())
    with wave.open(str(out / "0000_code2wav.wav"), "rb") as w:
        assert w.readframes(w.getnframes()) == streamed
    from transformers import AutoTokenizer

    from stages.qwen3_omni.inputs import render_chatml
    from tests.stages.qwen3_omni_utils import checkpoint

    tok = AutoTokenizer.from_pretrained(str(checkpoint("tiny")))
    ids = tok(render_chatml([{"role": "user", "content": PROMPT}], None))["input_ids"]
    _, frames, _ = hf_generate("tiny", ids, thinker_max=thinker_max, talker_max=talker_max, threads=THREADS)
    model = hf_model("tiny").code2wav
    x = torch.from_numpy(frames.T.copy())[None]
    bounds = [0, 4] + list(range(12, len(frames), 8)) + [len(frames)]
    spf = int(model.total_upsample)
    with torch.inference_mode(), torch_threads(THREADS):
        ref = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            c = 25 if s - 25 > 0 else s  # chunked_decode's left context rule
            ref.append(model(x[..., s - c : e])[..., c * spf :].reshape(-1).float().numpy())
    assert len(ref) >= 3
    assert_same_audio(streamed, np.concatenate(ref))


@pytest.mark.timeout(300)
def test_omni_run_streams_thinker_to_talker(tmp_path, capsys):
    """Both edges streaming: the talker starts on the thinker's first chunks (one thinker row per talker step)
    and code2wav on the talker's; with one code2wav window the text and the WAV are transformers' generate."""
    thinker_max, talker_max = _limits()
    overrides = {"talker": {"inputs": [{"stage": "thinker", "stream": True, "chunk_tokens": 1}]},
                 "code2wav": {"inputs": [{"stage": "talker", "stream": True, "chunk_tokens": 2}]}}
    out = tmp_path / "stream"
    rc = cli.main(["run", str(TINY), "--prompt", PROMPT, "--json", "--backend", "local", "--stream",
                   "--output-dir", str(out), "--stage-overrides", json.dumps(overrides)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    [result] = json.loads(captured.out.strip().splitlines()[-1])["results"]
    assert result["error"] is None
    from transformers import AutoTokenizer

    from stages.qwen3_omni.inputs import render_chatml
    from tests.stages.qwen3_omni_utils import checkpoint

    tok = AutoTokenizer.from_pretrained(str(checkpoint("tiny")))
    ids = tok(render_chatml([{"role": "user", "content": PROMPT}], None))["input_ids"]
    ref_tokens, _, ref_wav = hf_generate("tiny", ids, thinker_max=thinker_max, talker_max=talker_max, threads=THREADS)
    assert result["outputs"]["thinker"]["token_ids"] == ref_tokens
    with wave.open(str(out / "0000_code2wav.wav"), "rb") as w:
        assert_same_audio(w.readframes(w.getnframes()), ref_wav)
