"""A clip cut into speech segments by voice activity: what `/v1/audio/transcriptions` transcribes one by one when
a caller asks for timestamps (srt, vtt, verbose_json) or for OpenAI's `chunking_strategy`.

    probs = vad.speech_probabilities(wave, rate)                 # Silero VAD, one probability per 32 ms frame
    segments = speech_segments(probs, duration_s, VadOptions())  # [SpeechSegment(start_s, end_s, speech_prob)]

The rule is the realtime server VAD's (vad.TurnDetector), applied to the whole clip at once: speech starts at
the first frame whose probability reaches `threshold` and stops once it stayed below `threshold - 0.15` for
`silence_duration_ms`. Bursts shorter than MIN_SPEECH_MS are dropped (a click, a breath). A segment longer
than `max_segment_s` is cut at its quietest frame in the second half of that span, as often as needed: the
omni thinkers hear at most 30 s of audio in one clip window, and a subtitle line should not run longer. Each
segment then keeps `prefix_padding_ms` of audio before its speech and SUFFIX_PAD_MS after (the speech's first
and last phonemes sit under the VAD's threshold), never reaching into its neighbours' speech.

The timestamps are the segment's audio span (what the model heard), in seconds; a segment's `speech_prob` is
the mean probability over its speech frames (verbose_json's `no_speech_prob` is 1 minus it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni.serve.audio.vad import FRAME_MS, HYSTERESIS

MIN_SPEECH_MS = 250
SUFFIX_PAD_MS = 200


@dataclass(frozen=True, slots=True)
class VadOptions:
    """OpenAI's `server_vad` chunking parameters (the realtime server VAD's defaults)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    max_segment_s: float = 29.0  # the speech itself: with its padding a segment stays within one 30 s clip


@dataclass(frozen=True, slots=True)
class SpeechSegment:
    start_s: float
    end_s: float
    speech_prob: float


def _speech_runs(probs: np.ndarray, opts: VadOptions) -> list[tuple[int, int]]:
    """Frame ranges [first, end) of speech: TurnDetector's start / stop rule over the whole clip."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    quiet: int | None = None  # the first frame of the silence in progress
    silence_frames = opts.silence_duration_ms / FRAME_MS
    for i, p in enumerate(probs):
        if start is None:
            if p >= opts.threshold:
                start, quiet = i, None
            continue
        if p >= opts.threshold:
            quiet = None
        elif p < opts.threshold - HYSTERESIS and quiet is None:
            quiet = i
        if quiet is not None and i + 1 - quiet >= silence_frames:
            runs.append((start, quiet))
            start = quiet = None
    if start is not None:  # the clip ends in speech (or in a silence shorter than silence_duration_ms)
        runs.append((start, quiet if quiet is not None else len(probs)))
    min_frames = MIN_SPEECH_MS / FRAME_MS
    return [(a, b) for a, b in runs if b - a >= min_frames]


def _split_long(runs: list[tuple[int, int]], probs: np.ndarray, max_frames: int) -> list[tuple[int, int]]:
    """Runs longer than `max_frames` cut at the quietest frame of their second half, until none is."""
    out: list[tuple[int, int]] = []
    for a, b in runs:
        while b - a > max_frames:
            lo, hi = a + max_frames // 2, a + max_frames  # the cut leaves both parts non-empty and the first short
            cut = lo + int(np.argmin(probs[lo:hi]))
            out.append((a, cut))
            a = cut
        out.append((a, b))
    return out


def speech_segments(probs: np.ndarray, duration_s: float, opts: VadOptions) -> list[SpeechSegment]:
    """The clip's speech segments (see the module docstring), in order, padded, not overlapping."""
    probs = np.asarray(probs, np.float32)
    max_frames = max(2, int(opts.max_segment_s * 1000 / FRAME_MS))
    runs = _split_long(_speech_runs(probs, opts), probs, max_frames)
    frame_s = FRAME_MS / 1000
    segments: list[SpeechSegment] = []
    for k, (a, b) in enumerate(runs):
        speech_start, speech_end = a * frame_s, min(b * frame_s, duration_s)
        prev_end = runs[k - 1][1] * frame_s if k else 0.0
        next_start = runs[k + 1][0] * frame_s if k + 1 < len(runs) else duration_s
        start = max(speech_start - opts.prefix_padding_ms / 1000, prev_end, 0.0)
        # the next segment's prefix padding is taken from the gap first: the pads split what is left of it
        next_pad = max(next_start - opts.prefix_padding_ms / 1000, speech_end) if k + 1 < len(runs) else next_start
        end = min(speech_end + SUFFIX_PAD_MS / 1000, next_pad, duration_s)
        segments.append(SpeechSegment(round(start, 3), round(end, 3), float(probs[a:b].mean())))
    return segments
