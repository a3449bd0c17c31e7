"""Shared helpers for the video tests: the committed videos and transformers' reference outputs for them
(tests/data/make_video_reference.py made both, once, in an environment with torchvision)."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

from omni.messages import MultiModalInput, StageInput

DATA = Path(__file__).resolve().parents[1] / "data"
CLIPS = ("plain", "talk", "long")  # plain: no audio track
QUESTION = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens here?"}]}]


@functools.lru_cache(maxsize=None)
def reference() -> dict[str, np.ndarray]:
    with np.load(DATA / "video_reference.npz") as z:
        return {k: z[k] for k in z.files}


def clip_bytes(name: str) -> np.ndarray:
    return np.frombuffer((DATA / "video" / f"{name}.mp4").read_bytes(), dtype=np.uint8)


def sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()


def video_request(rid: str, name: str, with_audio: bool, prompt=None, **kw) -> StageInput:
    return StageInput(rid, prompt=QUESTION if prompt is None else prompt,
                      mm_inputs=[MultiModalInput("video", clip_bytes(name))],
                      mm_processor_kwargs={"use_audio_in_video": with_audio}, **kw)
