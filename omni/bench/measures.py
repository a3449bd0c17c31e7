"""The summaries every benchmark reports the same way, so that one benchmark's p99 or SNR means what
another's does.

    percentile(xs, q)   the q-th percentile of xs, linearly interpolated between the two nearest ranks
                        (numpy's default, "linear": the value at rank (n - 1) * q / 100 counted from 0,
                        between the sorted values around it); None when there is nothing to summarize
    snr_db(ref, got)    how far a waveform is from a reference: signal over difference power, in dB
                        (infinity when they are equal)
    AGREE_SNR_DB        the SNR at and above which two waveforms of the same math in another order agree
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

AGREE_SNR_DB = 100.0


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `xs`, interpolated linearly between the nearest ranks (see the
    module docstring); None for no values."""
    if len(xs) == 0:
        return None
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    """10 log10(|ref|^2 / |ref - got|^2) over the samples, in float64; infinity when `got` equals `ref`."""
    noise = float(((ref.astype(np.float64) - got) ** 2).sum())
    return float("inf") if noise == 0 else 10 * float(np.log10(float((ref.astype(np.float64) ** 2).sum()) / noise))
