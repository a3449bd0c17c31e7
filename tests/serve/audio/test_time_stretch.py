"""Speech `speed` (omni/serve/audio/time_stretch.py): the tempo changes, the pitch does not, the length is the input's
over the speed, and streaming gives the same samples as one call whatever the chunking."""
from __future__ import annotations

import numpy as np
import pytest

from omni.serve.audio.resampling import resample
from omni.serve.audio.time_stretch import TimeStretch, stretch
from tests.serve.realtime_utils import speech_24k

RATE = 24000


def _peak_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / RATE)[np.argmax(spectrum)])


def _ltas(x: np.ndarray, n: int = 1024) -> np.ndarray:
    """Long-term average magnitude spectrum (the voice's pitch harmonics and timbre), unit norm."""
    frames = np.lib.stride_tricks.sliding_window_view(x, n)[:: n // 2] * np.hanning(n)
    s = np.abs(np.fft.rfft(frames, axis=1)).mean(axis=0)
    return s / np.linalg.norm(s)


@pytest.mark.parametrize("speed", [0.25, 0.8, 1.25, 1.5, 2.0, 4.0])
def test_a_tone_keeps_its_pitch_and_level_at_any_speed(speed):
    t = np.arange(2 * RATE) / RATE
    x = (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    y = stretch(x, speed, RATE)
    assert y.dtype == np.float32 and len(y) == round(len(x) / speed)
    # Resampling would move it to 220 * speed; one FFT bin is RATE / len(y) wide.
    assert abs(_peak_hz(y) - 220) <= RATE / len(y) + 0.5
    inner = y[RATE // 20 : -RATE // 20]  # away from the zero-padded end
    assert np.sqrt(np.mean(inner**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.02)  # no gaps, no doubling


def test_recorded_speech_keeps_its_spectrum_where_resampling_would_not():
    x = speech_24k(4.0, offset_s=1.0)
    faster = stretch(x, 1.5, RATE)
    assert len(faster) == round(len(x) / 1.5)
    resampled = resample(x, RATE, round(RATE / 1.5))  # the same duration, played at RATE: a fifth higher
    kept, shifted = _ltas(x) @ _ltas(faster), _ltas(x) @ _ltas(resampled)
    assert kept > 0.99 and kept > shifted + 0.05, (kept, shifted)


@pytest.mark.parametrize("speed", [0.5, 1.3, 3.0])
def test_any_chunking_gives_the_same_samples(speed):
    x = speech_24k(2.0)
    whole = stretch(x, speed, RATE)
    rng = np.random.default_rng(int(speed * 10))
    ts, parts, i = TimeStretch(speed, RATE), [], 0
    while i < len(x):
        j = i + int(rng.integers(1, 3000))
        parts.append(ts.push(x[i:j]))
        i = j
    parts.append(ts.finish())
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert ts.finish().size == 0  # finished once


def test_speed_one_passes_the_samples_through_and_bad_speeds_are_refused():
    x = speech_24k(0.5)
    ts = TimeStretch(1.0, RATE)
    np.testing.assert_array_equal(np.concatenate([ts.push(x[:100]), ts.push(x[100:]), ts.finish()]), x)
    for bad in (0.2, 4.5, float("nan")):
        with pytest.raises(ValueError, match="speed"):
            TimeStretch(bad, RATE)
    assert stretch(np.zeros(10, np.float32), 2.0, RATE).tolist() == [0.0] * 5  # shorter than a frame
