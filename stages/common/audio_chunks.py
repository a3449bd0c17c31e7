"""The one chunk schedule of a streamed audio stage (token2wav's codes, code2wav's frames).

A listener plays the first chunk while the next one is made: a small first chunk gives a short time to first
audio, and later chunks start at the steady size and double up to a cap, so that each chunk's making stays
shorter than the audio already queued while few windows (each recomputes its context) are added.

The short last chunk: once the input is complete, the last chunk is whatever is left, however short. It is
never folded into the chunk before it, because folding changes the windows: code2wav's streamed waveform is
then no longer transformers' `chunked_decode` waveform (which cuts fixed windows and leaves a short last one),
and token2wav's streamed waveform stays within its bound of the one-shot waveform either way.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChunkSchedule:
    """Chunk sizes (in codes or frames): chunk 0 has `first`, chunk k >= 1 has `steady * 2**(k-1)`, at most `cap`."""

    first: int
    steady: int
    cap: int

    @classmethod
    def from_kwargs(cls, unit: str, steady: int, first: int | None = None, cap: int | None = None
                    ) -> ChunkSchedule:
        """The schedule of a stage's model_kwargs `first_chunk_{unit}` / `chunk_{unit}` / `max_chunk_{unit}`
        (None: `steady`); a ValueError naming the kwarg when one is out of range."""
        steady = int(steady)
        first = steady if first is None else int(first)
        cap = steady if cap is None else int(cap)
        for name, value in ((f"chunk_{unit}", steady), (f"first_chunk_{unit}", first)):
            if value < 1:
                raise ValueError(f"model_kwargs.{name}: must be >= 1, got {value}")
        if cap < steady:
            raise ValueError(f"model_kwargs.max_chunk_{unit}: must be >= chunk_{unit} ({steady}), got {cap}")
        return cls(first, steady, cap)

    def size(self, index: int) -> int:
        """Codes (frames) in chunk number `index`."""
        if index == 0:
            return self.first
        return min(self.cap, self.steady << min(index - 1, 30))

    def next_end(self, index: int, start: int, total: int, complete: bool, lookahead: int = 0) -> int | None:
        """End (exclusive) of chunk `index`, which starts at `start`, with `total` codes arrived so far, or None
        while it cannot be made yet: a chunk needs its codes and `lookahead` more, unless the input is
        complete (then the last chunk is what is left; start == total: an empty last piece)."""
        end = start + self.size(index)
        if complete:
            return min(end, total)
        return end if total >= end + lookahead else None
