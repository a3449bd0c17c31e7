"""The one percentile every benchmark reports (omni/bench/measures.py): linear interpolation between the
nearest ranks, numpy's default; and the SNR the audio benchmarks judge agreement by."""
from __future__ import annotations

import numpy as np
import pytest

from omni.bench.measures import AGREE_SNR_DB, percentile, snr_db


def test_percentile_interpolates_between_the_nearest_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4; rank (n - 1) * q / 100
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_snr_is_infinite_for_equal_waveforms_and_falls_with_the_difference():
    x = np.sin(np.linspace(0, 20, 1000)).astype(np.float32)
    assert snr_db(x, x.copy()) == float("inf")
    near, far = x + 1e-6, x + 1e-2
    assert snr_db(x, near) > AGREE_SNR_DB > snr_db(x, far)
