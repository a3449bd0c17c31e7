"""The forms a video takes in the Python API (omni/prompt_videos.py): a path, the file's bytes, frames, (frames, fps),
and mm_processor_kwargs; what is wrong is named before anything is queued."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omni.errors import RequestError
from omni.prompts import to_stage_input

CLIP = Path(__file__).resolve().parent / "data" / "video" / "talk.mp4"


def _inp(data, **kw):
    return to_stage_input({"prompt": "What happens?", "multi_modal_data": {"video": data}, **kw}, "prompts[0]",
                          lambda: "r")


@pytest.mark.parametrize("form", [str(CLIP), CLIP, CLIP.read_bytes(), np.frombuffer(CLIP.read_bytes(), np.uint8)])
def test_a_video_file_is_its_bytes(form):
    (m,) = _inp(form).mm_inputs
    assert m.modality == "video" and m.fps is None and m.data.dtype == np.uint8 and m.data.ndim == 1
    assert m.data.tobytes() == CLIP.read_bytes()


def test_frames_with_and_without_their_rate_and_the_processor_settings():
    frames = np.zeros((4, 8, 10, 3), np.uint8)
    (m,) = _inp(frames).mm_inputs
    assert m.fps is None and m.data.shape == (4, 8, 10, 3)
    inp = _inp([(frames, 2.5), (frames, 30)], mm_processor_kwargs={"use_audio_in_video": True})
    assert [m.fps for m in inp.mm_inputs] == [2.5, 30.0]
    assert inp.mm_processor_kwargs == {"use_audio_in_video": True}


@pytest.mark.parametrize("data,field,words", [
    ("/nonexistent/v.mp4", "multi_modal_data.video[0]", "no such file: /nonexistent/v.mp4"),
    (str(CLIP.parent), "multi_modal_data.video[0]", "not a file"),
    ((CLIP, 5.0), "multi_modal_data.video[0]", "a file gives its own frame rate"),
    ((np.zeros((4, 8, 8, 3), np.uint8), -1), "multi_modal_data.video[0].fps", "expected a number > 0"),
    ((np.zeros((4, 8, 8, 3), np.uint8), True), "multi_modal_data.video[0].fps", "expected a number > 0"),
    (np.zeros((8, 8, 3), np.uint8), "multi_modal_data.video[0]", "TxHxWxC array with C in (1, 3, 4), got shape"),
    ("", "multi_modal_data.video[0]", "expected a video file path, got an empty string"),
    (np.array(["a"]), "multi_modal_data.video[0]", "expected a file path, the file's bytes, or frames"),
])
def test_bad_videos_are_named(data, field, words):
    with pytest.raises(RequestError) as e:
        _inp(data)
    assert e.value.field == field and words in str(e.value) and str(e.value).startswith("prompts[0]: "), str(e.value)


def test_mm_processor_kwargs_must_be_a_dict():
    with pytest.raises(RequestError, match="mm_processor_kwargs: expected a dict"):
        to_stage_input({"prompt": "x", "mm_processor_kwargs": True}, "prompts[0]", lambda: "r")
