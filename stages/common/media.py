"""Checks of image and audio inputs, before any preprocessing touches them.

The API checks only the structure of `multi_modal_data` (omni/prompts.py); what the
arrays hold is the stage's business: a stage model calls these from `preprocess`, so
a bad input fails its own request at admission with a ValueError naming it
(`multi_modal_data.image[0]: ...`), never a ZeroDivisionError deep in a resize.
"""
from __future__ import annotations

import numpy as np

from omni.errors import RequestError
from omni.messages import MultiModalInput


def media_names(items: list[MultiModalInput]) -> list[str]:
    """`multi_modal_data.<modality>[k]` for each item, k counted per modality (as the API takes them)."""
    seen: dict[str, int] = {}
    names = []
    for m in items:
        k = seen.get(m.modality, 0)
        seen[m.modality] = k + 1
        names.append(f"multi_modal_data.{m.modality}[{k}]")
    return names


def _numbers(data: object, where: str) -> np.ndarray:
    arr = np.asarray(data)
    if not np.issubdtype(arr.dtype, np.number):
        raise RequestError(f"{where}: expected an array of numbers, got {arr.dtype}", field=where)
    if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
        raise RequestError(f"{where}: holds NaN or inf", field=where)
    return arr


def check_image(data: object, where: str) -> np.ndarray:
    """HxW (grey) or HxWxC with C in (1, 3, 4); uint8-like 0..255 or float 0..1; at least 1x1."""
    arr = _numbers(data, where)
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (1, 3, 4)):
        raise RequestError(f"{where}: expected an HxW or HxWxC array with C in (1, 3, 4), got shape {arr.shape}",
                           field=where)
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise RequestError(f"{where}: the image is empty ({arr.shape[0]}x{arr.shape[1]} pixels)", field=where)
    lo, hi = arr.min(), arr.max()
    if np.issubdtype(arr.dtype, np.floating) and not (0.0 <= lo and hi <= 1.0):
        raise RequestError(f"{where}: float pixel values must be in [0, 1], got [{lo:g}, {hi:g}] "
                         "(pass uint8 for 0..255)", field=where)
    if np.issubdtype(arr.dtype, np.integer) and not (0 <= lo and hi <= 255):
        raise RequestError(f"{where}: integer pixel values must be in 0..255, got [{lo}, {hi}]", field=where)
    return arr


def check_audio(data: object, sampling_rate: int | None, expected_rate: int, min_samples: int,
                where: str) -> np.ndarray:
    """A mono waveform (1-D) of >= `min_samples` finite samples at `expected_rate` Hz (None: assumed)."""
    if sampling_rate is not None and sampling_rate != expected_rate:
        raise RequestError(f"{where}: sampling_rate must be {expected_rate} Hz, got {sampling_rate} "
                         "(resample the waveform first)", field=where)
    arr = _numbers(data, where)
    if arr.ndim != 1:
        raise RequestError(f"{where}: expected a mono 1-D waveform, got shape {arr.shape}", field=where)
    if arr.size < min_samples:
        raise RequestError(f"{where}: {arr.size} samples, at least {min_samples} are needed "
                         f"({min_samples / expected_rate * 1000:g} ms at {expected_rate} Hz)", field=where)
    return arr
