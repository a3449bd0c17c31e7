"""`omni run --prompts-file` with media named by path (omni/prompt_media.py): an audio clip and images,
relative to the prompts file's folder, read as the Python API takes them ((waveform, the file's rate); an
HxWx3 uint8 array) and run through the tiny Qwen2.5-Omni in this process (local backend).

The errors (a missing or unreadable file: exit 2 naming the line, the field and the file, before anything
loads) are in tests/test_cli_errors.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omni import cli
from tests.serve.realtime_utils import speech_wav

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "stage_configs" / "qwen2_5_omni_tiny.yaml"


class Prompts:
    """Records the prompts `omni run` hands to Omni.generate."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from omni.api import Omni

        self.seen: list[Any] = []
        original = Omni.generate

        def generate(omni: Any, prompts: Any, *args: Any, **kw: Any):
            self.seen.extend(prompts)
            return original(omni, prompts, *args, **kw)

        monkeypatch.setattr(Omni, "generate", generate)


@pytest.mark.slow
def test_prompts_file_audio_and_images_by_path_on_the_tiny_omni(tmp_path, capsys, monkeypatch):
    spy = Prompts(monkeypatch)
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(speech_wav(), media / "clip.wav")  # real recorded speech, 16 kHz mono
    pixels = np.random.default_rng(0).integers(0, 256, size=(40, 56, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(media / "cat.png")
    Image.fromarray(pixels[::-1].copy()).save(media / "dog.png")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        "What is in the picture?",
        {"prompt": "What does she say?", "multi_modal_data": {"audio": "media/clip.wav"}},
        {"prompt": "What is in the picture?", "multi_modal_data": {"image": "media/cat.png"}},
        {"prompt": "What is in the picture?", "multi_modal_data": {"image": ["media/cat.png", str(media / "dog.png")]}},
    ]) + "\n")

    rc = cli.main(["run", str(TINY), "--prompts-file", str(prompts), "--backend", "local", "--max-tokens", "2",
                   "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]

    # What the files hold, as the Python API takes it: (waveform, the file's own rate); RGB uint8 arrays.
    _, audio, image, images = spy.seen
    wave, rate = audio["multi_modal_data"]["audio"]  # one clip, as {"audio": (wave, rate)} in the API
    expected, expected_rate = sf.read(speech_wav(), dtype="float32")
    assert rate == expected_rate == 16000 and np.array_equal(wave, expected)
    assert np.array_equal(image["multi_modal_data"]["image"], pixels)
    first, second = images["multi_modal_data"]["image"]
    assert np.array_equal(first, pixels) and np.array_equal(second, pixels[::-1])

    # Every request ran, and the media reached the thinker: its prompt holds their tokens.
    results = json.loads(captured.out.strip().splitlines()[-1])["results"]
    assert [r["error"] for r in results] == [None] * 4
    tokens = [r["outputs"]["thinker"]["num_prompt_tokens"] for r in results]
    assert tokens[1] > tokens[0] + 100  # ~10 s of audio: hundreds of audio tokens
    assert tokens[2] > tokens[0] and tokens[3] > tokens[2]
    assert all(r["outputs"]["token2wav"]["audio_samples"] > 0 for r in results)
    assert results[1]["prompt"] == "What does she say?"  # the prompt's text, not its waveform


@pytest.mark.slow
def test_prompts_file_video_by_path_with_its_track_on_the_tiny_omni(tmp_path, capsys, monkeypatch):
    """A video named by path reaches the API as the file's bytes (the stage samples and decodes it), with and
    without its audio track interleaved (mm_processor_kwargs.use_audio_in_video), through the whole chain."""
    spy = Prompts(monkeypatch)
    clip = REPO / "tests" / "data" / "video" / "talk.mp4"
    shutil.copy(clip, tmp_path / "talk.mp4")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        {"prompt": "What happens?", "multi_modal_data": {"video": "talk.mp4"}},
        {"prompt": "What happens?", "multi_modal_data": {"video": "talk.mp4"},
         "mm_processor_kwargs": {"use_audio_in_video": True}},
    ]) + "\n")
    rc = cli.main(["run", str(TINY), "--prompts-file", str(prompts), "--backend", "local", "--max-tokens", "2",
                   "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    video = spy.seen[0]["multi_modal_data"]["video"]
    assert video.dtype == np.uint8 and video.tobytes() == clip.read_bytes()
    results = json.loads(captured.out.strip().splitlines()[-1])["results"]
    assert [r["error"] for r in results] == [None, None]
    plain, with_track = (r["outputs"]["thinker"]["num_prompt_tokens"] for r in results)
    assert with_track == plain + 72  # 2.8 s of audio: 70 audio tokens, between the audio bos and eos
    assert all(r["outputs"]["token2wav"]["audio_samples"] > 0 for r in results)
