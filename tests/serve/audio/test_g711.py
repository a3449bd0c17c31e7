"""G.711 for /v1/realtime (omni/serve/audio/g711.py): mu-law and A-law bit for bit what Python's own audioop computes,
and the streaming 8 kHz <-> 24 kHz resampler: in tune, alias-free, the same samples however the stream is cut."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from omni.serve.audio import g711
from omni.serve.audio.resampling import DELAY, Resampler8k24k

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    audioop = pytest.importorskip("audioop")  # the reference (Python's C implementation; gone in 3.13)

EVERY_INT16 = np.arange(-32767, 32768, dtype=np.int16)  # -32768 is clipped to -32767 by the float path


@pytest.mark.parametrize("fmt, lin2, to_lin", [("audio/pcmu", "lin2ulaw", "ulaw2lin"),
                                               ("audio/pcma", "lin2alaw", "alaw2lin")])
def test_codec_is_audioops_bit_for_bit(fmt, lin2, to_lin):
    x = EVERY_INT16.astype(np.float32) / 32767.0  # floats that the pcm16 path maps back to every int16
    assert g711.encode(fmt, x) == getattr(audioop, lin2)(EVERY_INT16.tobytes(), 2)
    codes = bytes(range(256))
    want = np.frombuffer(getattr(audioop, to_lin)(codes, 2), "<i2")
    np.testing.assert_array_equal(np.round(g711.decode(fmt, codes) * 32767.0).astype(np.int16), want)


def _snr_db(x: np.ndarray, ref: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(ref**2) / np.mean((x - ref) ** 2)))


def test_up_and_down_keep_a_tone_and_drop_what_8k_cannot_hold():
    t8 = np.arange(8000) / 8000
    up = Resampler8k24k(up=True).push(0.5 * np.sin(2 * np.pi * 1000 * t8))
    ideal = 0.5 * np.sin(2 * np.pi * 1000 * (np.arange(24000) - DELAY) / 24000)  # the filter's group delay
    assert up.size == 24000 and _snr_db(up[200:-200], ideal[200:-200]) > 60
    down = Resampler8k24k(up=False).push(ideal)
    assert down.size == 8000
    want = 0.5 * np.sin(2 * np.pi * 1000 * (np.arange(8000) * 3 - 2 * DELAY) / 24000)
    assert _snr_db(down[100:-100], want[100:-100]) > 60
    high = Resampler8k24k(up=False).push(0.5 * np.sin(2 * np.pi * 6000 * np.arange(24000) / 24000))  # above 4 kHz
    assert 10 * np.log10(np.mean(high[100:] ** 2) / 0.125) < -60  # filtered, not aliased to 2 kHz


@pytest.mark.parametrize("up", [True, False])
def test_any_chunking_gives_the_same_samples(up):
    x = np.random.default_rng(0).standard_normal(9001).astype(np.float32) * 0.3
    whole = Resampler8k24k(up).push(x)
    r, parts, i = Resampler8k24k(up), [], 0
    rng = np.random.default_rng(1)
    while i < x.size:
        j = i + int(rng.integers(0, 700))
        parts.append(r.push(x[i:j]))
        i = j
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert whole.size == (x.size * 3 if up else -(-x.size // 3))
