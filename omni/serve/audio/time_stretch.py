"""Speech `speed`: change the tempo of a waveform without changing its pitch (WSOLA), streaming.

Resampling would change the tempo and the pitch together (1.5x faster = a fifth higher). WSOLA (waveform
similarity overlap-add; Verhelst & Roelands, ICASSP 1993) keeps the pitch: the output is built from frames of
the input (N = 30 ms, Hann-windowed) overlap-added every Hs = N/2 samples, frame k taken near the input position
k * Hs * speed; "near": within +-10 ms, at the shift whose frame best continues the frame before it (the largest
cross-correlation with the input that followed that frame), so that the overlapped frames are in phase and no
period is doubled or cut. The first frame's leading half is unwindowed, so the output starts at full level.

Streaming: `push` takes the samples as the pipeline yields them and returns the output that is final (every
frame overlapping it added), `finish` the rest (the input zero-padded past its end), round(len / speed) samples
in all. A frame is computed only once every input sample it may read has arrived, and what it reads does not
depend on how the input was cut, so any chunking gives the same output as one `push` of the whole (tested).
"""
from __future__ import annotations

import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range for /v1/audio/speech
FRAME_S = 0.030
SEARCH_S = 0.010


class TimeStretch:
    """One waveform's tempo change by `speed` (> 1: faster, shorter) at sample rate `rate`."""

    def __init__(self, speed: float, rate: int):
        if not (MIN_SPEED <= speed <= MAX_SPEED):
            raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        self.speed, self.rate = float(speed), int(rate)
        self.n = max(4, 2 * round(FRAME_S * rate / 2))  # even frame length
        self.hop = self.n // 2  # synthesis hop: Hann windows at half overlap sum to 1
        self.search = max(1, round(SEARCH_S * rate))
        k = np.arange(self.n)
        self.window = (0.5 - 0.5 * np.cos(2 * np.pi * k / self.n)).astype(np.float64)  # periodic Hann
        self.first_window = self.window.copy()
        self.first_window[: self.hop] = 1.0
        self.x = np.zeros(0, np.float64)  # every input sample so far
        self.y = np.zeros(0, np.float64)  # output accumulator, from sample `self.emitted` on
        self.emitted = 0  # output samples returned so far
        self.frame = 0  # next frame index
        self.prev = 0  # input position of the previous frame
        self.done = False

    def _analysis(self, k: int) -> int:
        return int(round(k * self.hop * self.speed))

    def _needs(self, k: int) -> int:
        """Input samples frame k may read: its search range and the continuation of the frame before it."""
        if k == 0:
            return self.n
        return max(self._analysis(k) + self.search + self.n, self.prev + self.hop + self.n)

    def _add_frame(self, x: np.ndarray) -> None:
        k = self.frame
        if k == 0:
            pos, window = 0, self.first_window
        else:
            a = self._analysis(k)
            lo, hi = max(0, a - self.search), a + self.search
            natural = x[self.prev + self.hop : self.prev + self.hop + self.n]
            region = x[lo : hi + self.n]
            scores = np.correlate(region, natural, mode="valid")  # one per shift lo..hi
            pos = lo + int(np.argmax(scores))
            window = self.window
        start = k * self.hop - self.emitted
        if len(self.y) < start + self.n:
            self.y = np.concatenate([self.y, np.zeros(start + self.n - len(self.y))])
        self.y[start : start + self.n] += window * x[pos : pos + self.n]
        self.prev, self.frame = pos, k + 1

    def _emit(self, upto: int) -> np.ndarray:
        """Output samples [emitted, upto) (final: no later frame overlaps them), float32."""
        count = max(0, upto - self.emitted)
        out, self.y = self.y[:count], self.y[count:]
        self.emitted += count
        return out.astype(np.float32)

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Append input; returns the output samples that became final."""
        if self.done:
            raise RuntimeError("push after finish")
        if self.speed == 1.0:
            return np.asarray(samples, np.float32).reshape(-1)
        self.x = np.concatenate([self.x, np.asarray(samples, np.float64).reshape(-1)])
        while self._needs(self.frame) <= len(self.x):
            self._add_frame(self.x)
        # Frame f covers [f * hop, f * hop + n): output before the next frame's start is final.
        return self._emit(self.frame * self.hop)

    def finish(self) -> np.ndarray:
        """The rest of the output: round(input length / speed) samples in all."""
        if self.done:
            return np.zeros(0, np.float32)
        self.done = True
        if self.speed == 1.0:
            return np.zeros(0, np.float32)
        total = int(round(len(self.x) / self.speed))
        # Frames until every output sample up to `total` has both its overlapping frames (zeros past the input).
        while self.frame * self.hop < total + self.hop:
            need = self._needs(self.frame)
            padded = self.x if need <= len(self.x) else np.concatenate([self.x, np.zeros(need - len(self.x))])
            self._add_frame(padded)
        return self._emit(total)


def stretch(samples: np.ndarray, speed: float, rate: int) -> np.ndarray:
    """The whole waveform at `speed` (TimeStretch in one push)."""
    ts = TimeStretch(speed, rate)
    return np.concatenate([ts.push(samples), ts.finish()])
