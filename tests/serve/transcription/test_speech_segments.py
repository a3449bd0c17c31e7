"""Speech segments for timestamped transcripts (speech_segments.py) and their formats (transcript_formats.py):
the start / stop rule on exact probability sequences, padding that never reaches a neighbour's speech, long
speech cut at its quietest frame, Silero on real recorded speech with a silence put in it, and srt / vtt /
verbose_json written as OpenAI's clients and subtitle players read them."""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from omni.messages import TokenLogprob
from omni.serve.transcription.speech_segments import (MIN_SPEECH_MS, SUFFIX_PAD_MS, SpeechSegment, VadOptions,
                                                      speech_segments)
from omni.serve.transcription.formats import (
    TranscriptSegment, compression_ratio, cue_text, joined_text, timestamp, to_srt, to_verbose_json, to_vtt)
from omni.serve.audio.vad import FRAME_MS, speech_probabilities

F = FRAME_MS / 1000  # seconds a frame


def probs(*runs: tuple[float, int]) -> np.ndarray:
    """A probability sequence from (value, frames) runs."""
    return np.concatenate([np.full(n, v, np.float32) for v, n in runs])


def test_speech_starts_at_threshold_and_stops_after_the_silence_duration():
    # speech frames 10..29; then 0.4 (under the threshold but above threshold - 0.15: not yet silence) for 5
    # frames; then quiet. The stop is at the first quiet frame (35), the silence being 500 ms = 15.6 frames.
    p = probs((0.1, 10), (0.9, 20), (0.4, 5), (0.05, 40))
    opts = VadOptions(threshold=0.5, prefix_padding_ms=0, silence_duration_ms=500)
    (seg,) = speech_segments(p, len(p) * F, opts)
    assert seg.start_s == round(10 * F, 3)
    assert seg.end_s == round(35 * F + SUFFIX_PAD_MS / 1000, 3)
    assert seg.speech_prob == pytest.approx((20 * 0.9 + 5 * 0.4) / 25)


def test_a_short_silence_does_not_split_and_a_long_one_does():
    p = probs((0.0, 5), (1.0, 20), (0.0, 10), (1.0, 20), (0.0, 30), (1.0, 20), (0.0, 5))
    opts = VadOptions(prefix_padding_ms=0, silence_duration_ms=500)  # 10 frames = 320 ms < 500 ms < 30 frames
    segs = speech_segments(p, len(p) * F, opts)
    assert [s.start_s for s in segs] == [round(5 * F, 3), round(85 * F, 3)]
    # the last segment ends with the clip (speech followed by a silence shorter than the silence duration)
    assert segs[1].end_s == round(len(p) * F, 3)


def test_bursts_shorter_than_min_speech_are_dropped():
    short = int(MIN_SPEECH_MS / FRAME_MS)  # 7 frames = 224 ms < 250 ms
    p = probs((0.0, 20), (1.0, short), (0.0, 40), (1.0, short + 1), (0.0, 40))
    segs = speech_segments(p, len(p) * F, VadOptions(prefix_padding_ms=0))
    assert [s.start_s for s in segs] == [round((20 + short + 40) * F, 3)]


def test_padding_takes_the_gap_but_never_a_neighbours_speech():
    # two speech runs 10 frames (320 ms) apart, split by a 300 ms silence duration: the second one's 300 ms of
    # prefix padding would reach back to 20 ms after the first one's speech, the first one's 200 ms suffix to
    # 120 ms into the gap: the suffix stops where the prefix starts.
    p = probs((0.0, 30), (1.0, 20), (0.0, 10), (1.0, 20), (0.0, 30))
    segs = speech_segments(p, len(p) * F, VadOptions(prefix_padding_ms=300, silence_duration_ms=300))
    assert len(segs) == 2
    first_end, second_start = 50 * F, 60 * F
    assert segs[0].start_s == round(30 * F - 0.3, 3)
    assert segs[1].start_s == round(second_start - 0.3, 3)
    assert segs[0].end_s == round(min(first_end + SUFFIX_PAD_MS / 1000, second_start - 0.3), 3)
    assert segs[0].end_s <= segs[1].start_s
    # a prefix longer than the gap stops at the previous speech's end
    segs = speech_segments(p, len(p) * F, VadOptions(prefix_padding_ms=1000, silence_duration_ms=300))
    assert segs[1].start_s == round(first_end, 3) == segs[0].end_s
    assert segs[0].start_s == 0.0  # and at the clip's start


def test_long_speech_is_cut_at_its_quietest_frame():
    # 3 s of speech with one dip at frame 70 (inside the second half of a 2.5 s span): cut there
    p = probs((1.0, 70), (0.6, 1), (1.0, 29), (0.0, 30))
    opts = VadOptions(prefix_padding_ms=0, max_segment_s=2.5)
    segs = speech_segments(p, len(p) * F, opts)
    assert [(s.start_s, s.end_s) for s in segs][0] == (0.0, round(70 * F, 3))
    assert segs[1].start_s == round(70 * F, 3)
    assert all(s.end_s - s.start_s <= 2.5 + SUFFIX_PAD_MS / 1000 for s in segs)


def test_no_speech_gives_no_segment():
    assert speech_segments(np.full(100, 0.2, np.float32), 100 * F, VadOptions()) == []
    assert speech_segments(np.zeros(0, np.float32), 0.0, VadOptions()) == []


def test_silero_finds_a_silence_put_into_real_speech():
    """Moonshine's recorded reading with 1.5 s of digital silence inserted mid-phrase: one segment ends inside the
    silence and the next starts inside it, and every segment holds speech (Silero's probability is high in it)."""
    import soundfile as sf

    from tests.serve.realtime_utils import speech_wav

    x, rate = sf.read(str(speech_wav()), dtype="float32")
    # 2.24 s is inside the reader's second phrase (~1.9-2.8 s): speech on both sides of the silence
    gap_start, gap = 2.24, 1.5
    cut = int(gap_start * rate)
    clip = np.concatenate([x[:cut], np.zeros(int(gap * rate), np.float32), x[cut:]])
    p = speech_probabilities(clip, rate)
    assert p.size == -(-clip.size // 512)
    segs = speech_segments(p, clip.size / rate, VadOptions())
    assert len(segs) >= 4
    ends = [s.end_s for s in segs]
    assert any(gap_start <= e <= gap_start + gap for e in ends)
    assert any(gap_start <= s.start_s <= gap_start + gap for s in segs)
    for s in segs:
        assert s.speech_prob > 0.6 and p[int(s.start_s / F):int(s.end_s / F) + 1].max() > 0.9
        assert 0 <= s.start_s < s.end_s <= clip.size / rate
    assert all(a.end_s <= b.start_s for a, b in zip(segs, segs[1:]))


def _seg(start: float, end: float, text: str, tokens: list[tuple[int, float]], prob: float = 0.9):
    return TranscriptSegment(SpeechSegment(start, end, prob), text, [TokenLogprob(t, lp) for t, lp in tokens])


SEGS = [_seg(0.052, 1.416, " Hello there.", [(9, -0.5), (7, -1.5)]),
        _seg(1.588, 3.0, "", [(2, -0.1)], 0.7),
        _seg(3661.5, 3662.25, "How are you?\n", [(4, -0.25)])]


def test_cue_text_cannot_break_a_subtitle_file():
    assert cue_text("  one\n\n two --> three \n") == "one\ntwo -> three"
    assert to_srt([_seg(0, 1, "a\n\n\nb", [])]) == "1\n00:00:00,000 --> 00:00:01,000\na\nb\n\n"


def test_timestamps_round_to_milliseconds():
    assert timestamp(3661.5, ",") == "01:01:01,500"
    assert timestamp(0.0015, ".") == "00:00:00.002"
    assert timestamp(59.9996, ".") == "00:01:00.000"


def test_srt_and_vtt_cues():
    assert to_srt(SEGS) == ("1\n00:00:00,052 --> 00:00:01,416\nHello there.\n\n"
                            "2\n01:01:01,500 --> 01:01:02,250\nHow are you?\n\n")
    assert to_vtt(SEGS) == ("WEBVTT\n\n00:00:00.052 --> 00:00:01.416\nHello there.\n\n"
                            "01:01:01.500 --> 01:01:02.250\nHow are you?\n\n")
    assert joined_text(SEGS) == "Hello there. How are you?"


def test_verbose_json_segments():
    body = json.loads(json.dumps(to_verbose_json(SEGS, task="transcribe", language="en", duration_s=3700.12345,
                                                 temperature=0.0, usage={"type": "tokens"})))
    assert body["task"] == "transcribe" and body["language"] == "en" and body["duration"] == 3700.123
    assert body["text"] == "Hello there. How are you?"
    first, empty, last = body["segments"]
    assert first == {"id": 0, "seek": 5, "start": 0.052, "end": 1.416, "text": "Hello there.", "tokens": [9, 7],
                     "temperature": 0.0, "avg_logprob": -1.0,
                     "compression_ratio": len(b"Hello there.") / len(zlib.compress(b"Hello there.")),
                     "no_speech_prob": pytest.approx(0.1)}
    assert empty["text"] == "" and empty["no_speech_prob"] == pytest.approx(0.3) and empty["id"] == 1
    assert last["seek"] == 366150 and last["avg_logprob"] == -0.25
    assert compression_ratio("") == 0.0
    translated = to_verbose_json(SEGS[:1], task="translate", language=None, duration_s=1, temperature=0.2, usage={})
    assert translated["language"] == "en" and translated["segments"][0]["temperature"] == 0.2
    assert to_verbose_json([], task="transcribe", language=None, duration_s=1, temperature=0,
                           usage={})["language"] == "unknown"


def test_a_long_clip_is_heard_as_equal_clips_and_its_token_bound_is_a_bound():
    """A transcription of 70 s: three clips of the encoder's 30 s window at most, equal (no sliver shorter than the
    encoder's first window), in one request; its generous token bound is a bound only (max_tokens_fit: a clip
    whose prompt fits the context is transcribed, it was refused for the bound's sake)."""
    from omni.serve.generation.asr_job import asr_job, max_tokens_for
    from omni.serve.audio.codecs import clips
    from omni.serve.state import PipelineInfo

    info = PipelineInfo("m", ["thinker"], "thinker", "thinker", None)
    wave = np.arange(16000 * 70, dtype=np.float32)
    job = asr_job(info, wave, 16000)
    assert job.sampling["thinker"]["max_tokens_fit"] is True
    assert job.sampling["thinker"]["max_tokens"] == max_tokens_for(70)
    parts = [m.data for m in job.prompt.mm_inputs]
    assert [p.shape[0] for p in parts] == [373334, 373334, 373332]
    np.testing.assert_array_equal(np.concatenate(parts), wave)
    assert [c["type"] for c in job.prompt.prompt[1]["content"]] == ["audio", "audio", "audio", "text"]
    assert len(clips(wave[:16000 * 30], 16000)) == 1
