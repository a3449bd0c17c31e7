"""Resampling, one-shot and streaming.

    resample(x, src, dst)   band-limited (FFT) resampling of a whole waveform, e.g. to the rate the model expects
    Resampler8k24k          8 kHz <-> 24 kHz as a stream (G.711's rate <-> the Realtime protocol's pcm rate, which
                            everything inside a session runs at): a linear-phase low-pass FIR (cutoff 3.6 kHz,
                            below the 4 kHz Nyquist of 8 kHz) with its history carried from chunk to chunk, so that
                            a stream cut into chunks anywhere resamples to the same samples as in one piece (the
                            samples come out `DELAY` 24 kHz samples, 2 ms, late: the filter's group delay; a reply's
                            last 2 ms stay in the filter, as a phone line's would)
"""
from __future__ import annotations

import numpy as np


def resampled_length(n: int, src: int, dst: int) -> int:
    """Samples of `n` samples at `src` Hz once resampled to `dst` Hz (what `resample` returns)."""
    return n if src == dst or n == 0 else max(1, round(n * dst / src))


def resample(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Resample a mono waveform from `src` to `dst` Hz (FFT: exact for band-limited signals, no aliasing)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if src == dst or x.size == 0:
        return x
    n_out = resampled_length(x.size, src, dst)
    spec = np.fft.rfft(x.astype(np.float64))
    out = np.zeros(n_out // 2 + 1, dtype=np.complex128)
    k = min(spec.size, out.size)
    out[:k] = spec[:k]
    if n_out < x.size and n_out % 2 == 0:
        out[-1] = out[-1].real  # the new Nyquist bin of a real signal is real
    return (np.fft.irfft(out, n_out) * (n_out / x.size)).astype(np.float32)


_TAPS = 97  # odd: a whole-sample group delay of 48 samples at 24 kHz
DELAY = (_TAPS - 1) // 2  # at 24 kHz


def _lowpass() -> np.ndarray:
    n = np.arange(_TAPS) - DELAY
    cutoff = 3600.0 / 24000.0  # cycles per sample at 24 kHz
    h = 2 * cutoff * np.sinc(2 * cutoff * n) * np.blackman(_TAPS)
    return h / h.sum()


_H = _lowpass()


class Resampler8k24k:
    """Streaming resampling by 3: `up=True` 8 kHz -> 24 kHz (zero-stuffing then the low-pass, gain 3), else
    24 kHz -> 8 kHz (the low-pass then every third sample). `push` returns what the chunk makes: exactly 3x (up)
    its samples, or every third of all samples pushed so far (down), the same however the stream is cut."""

    def __init__(self, up: bool):
        self.up = up
        self.history = np.zeros(_TAPS - 1, np.float64)  # the last 24 kHz samples before this chunk
        self.phase = 0  # down: how many 24 kHz samples to skip before the next kept one

    def push(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64).reshape(-1)
        if self.up:
            stream = np.zeros(x.size * 3)
            stream[::3] = x * 3.0
        else:
            stream = x
        if stream.size == 0:
            return np.zeros(0, np.float32)
        full = np.concatenate([self.history, stream])
        y = np.convolve(full, _H, mode="valid")  # one output per new 24 kHz sample
        self.history = full[-(_TAPS - 1):]
        if self.up:
            return y.astype(np.float32)
        kept = y[self.phase::3]
        self.phase = (self.phase - y.size) % 3
        return kept.astype(np.float32)
