"""A video under `multi_modal_data.video`, in the forms the Python API takes, as a MultiModalInput.

    "clip.mp4" | Path("clip.mp4")    a file (mp4, webm, mkv, mov, ...), read here: the stage decodes it
    b"..." | a 1-D uint8 array        the file's bytes
    frames                            decoded frames, TxHxWxC (C in 1, 3, 4) numbers 0..255: all of them are
                                      taken, as sampled at the model's frame rate (transformers' processors
                                      take frames handed over without a frame rate so)
    (frames, fps)                     decoded frames at `fps` frames per second: the stage samples them at
                                      its model's rate, as it does a file's

Structure only: the stage probes and decodes the file, and checks the frames and every limit (frames, seconds,
pixels, bytes), naming the field. A missing or unreadable file is a RequestError naming the field and the file.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from omni.errors import RequestError
from omni.messages import MultiModalInput

MAX_FILE_BYTES = 1 << 30  # a file larger than this is refused before it is read (the stage's own limit is lower)


def _bad(where: str, field: str, text: str) -> RequestError:
    return RequestError(": ".join(x for x in (where, field, text) if x), field=field)


def read_video_file(path: str | os.PathLike, where: str, field: str) -> np.ndarray:
    """A video file's bytes as a 1-D uint8 array (RequestError naming the field and the file)."""
    file = Path(path).expanduser()
    if not str(path).strip():
        raise _bad(where, field, "expected a video file path, got an empty string")
    if not file.exists():
        raise _bad(where, field, f"no such file: {file}")
    if not file.is_file():
        raise _bad(where, field, f"not a file: {file}")
    size = file.stat().st_size
    if size > MAX_FILE_BYTES:
        raise RequestError(f"{where + ': ' if where else ''}{field}: {file} holds {size} bytes, more than "
                           f"{MAX_FILE_BYTES}", field=field, limit=MAX_FILE_BYTES, actual=size)
    try:
        return np.frombuffer(file.read_bytes(), dtype=np.uint8)
    except OSError as e:
        raise _bad(where, field, f"cannot read {file}: {e.strerror or e}") from None


def check_video_stream(data: np.ndarray, where: str) -> np.ndarray:
    """`data` (a file's bytes) when PyAV finds a video stream in it; a RequestError naming `where` otherwise. The
    stage probes it again at admission, with its limits: this is the CLI's check before the models load."""
    import io

    import av

    try:
        with av.open(io.BytesIO(data.tobytes()), mode="r") as c:
            if c.streams.video:
                return data
    except (av.FFmpegError, ValueError) as e:
        raise RequestError(f"{where}: not a readable video file: {e}") from None
    raise RequestError(f"{where}: the file holds no video stream")


def video_input(item: Any, where: str, field: str) -> MultiModalInput:
    """One `multi_modal_data.video[k]` item -> MultiModalInput("video", ...)."""
    fps = None
    if isinstance(item, tuple):
        if len(item) != 2:
            raise _bad(where, field, f"expected (frames, fps), got a tuple of {len(item)}")
        item, fps = item
        if isinstance(fps, bool) or not isinstance(fps, (int, float, np.integer, np.floating)) or not fps > 0 \
                or not np.isfinite(fps):
            raise _bad(where, f"{field}.fps", f"expected a number > 0 (frames per second), got {fps!r}")
        fps = float(fps)
    if isinstance(item, (str, os.PathLike)):
        if fps is not None:
            raise _bad(where, field, "a file gives its own frame rate: pass the path alone")
        return MultiModalInput("video", read_video_file(item, where, field))
    if isinstance(item, (bytes, bytearray, memoryview)):
        if fps is not None:
            raise _bad(where, field, "a file gives its own frame rate: pass its bytes alone")
        return MultiModalInput("video", np.frombuffer(bytes(item), dtype=np.uint8))
    try:
        arr = np.asarray(item)
    except ValueError:  # ragged nested lists
        arr = np.asarray(None)
    if not np.issubdtype(arr.dtype, np.number):
        raise _bad(where, field, f"expected a file path, the file's bytes, or frames (an array of numbers), got "
                   f"{type(item).__name__} ({arr.dtype})")
    if arr.ndim == 1 and arr.dtype == np.uint8 and fps is None:
        return MultiModalInput("video", arr)  # a file's bytes
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3, 4):
        raise _bad(where, field, f"expected frames as a TxHxWxC array with C in (1, 3, 4), got shape {arr.shape}")
    return MultiModalInput("video", arr, fps=fps)
