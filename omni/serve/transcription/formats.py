"""Timestamped transcripts in OpenAI's response formats: `verbose_json`, `srt` and `vtt`, from the segments a clip
was transcribed in (transcription/speech_segments.py).

    verbose_json  {"task", "language", "duration", "text", "segments": [{"id", "seek", "start", "end", "text",
                  "tokens", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob"}], "usage"}
    srt           "1\\n00:00:01,250 --> 00:00:03,500\\nHello there.\\n\\n2\\n..."
    vtt           "WEBVTT\\n\\n00:00:01.250 --> 00:00:03.500\\nHello there.\\n\\n..."

A segment's fields as Whisper defines them where omni has the same quantity: `tokens` (the reply's token ids),
`avg_logprob` (their mean log-probability, from the raw logits), `compression_ratio` (the text's UTF-8 bytes over
their zlib-compressed size: Whisper's repetition check), `temperature` (the request's), `seek` (where the audio
the segment was decoded from starts, in Whisper's 10 ms units). `no_speech_prob` is the voice-activity model's
(1 - the segment's mean speech probability): the omni thinkers have no no-speech token.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from omni.messages import TokenLogprob
from omni.serve.transcription.speech_segments import SpeechSegment


@dataclass(frozen=True, slots=True)
class TranscriptSegment:
    span: SpeechSegment
    text: str
    token_logprobs: list[TokenLogprob]  # the reply's tokens, each with its log-probability
    language: str | None = None  # the language a speech recognizer's tag named (generation/transcript.py)


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def joined_text(segments: list[TranscriptSegment]) -> str:
    return " ".join(t for t in (s.text.strip() for s in segments) if t)


def timestamp(seconds: float, decimal: str) -> str:
    """HH:MM:SS,mmm (srt: decimal ",") or HH:MM:SS.mmm (vtt: ".")."""
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def cue_text(text: str) -> str:
    """A segment's text as a subtitle cue holds it: a blank line would end the cue and "-->" start a timing line,
    so its lines are kept without blank ones and the arrow becomes "->" (as Whisper's own writers do)."""
    return "\n".join(line.strip() for line in text.replace("-->", "->").splitlines() if line.strip())


def _cues(segments: list[TranscriptSegment]) -> list[tuple[TranscriptSegment, str]]:
    # a segment the model heard nothing in has no line to show (a subtitle cue must not be empty)
    return [(s, cue) for s in segments if (cue := cue_text(s.text))]


def to_srt(segments: list[TranscriptSegment]) -> str:
    return "".join(f"{i}\n{timestamp(s.span.start_s, ',')} --> {timestamp(s.span.end_s, ',')}\n{cue}\n\n"
                   for i, (s, cue) in enumerate(_cues(segments), 1))


def to_vtt(segments: list[TranscriptSegment]) -> str:
    return "WEBVTT\n\n" + "".join(f"{timestamp(s.span.start_s, '.')} --> {timestamp(s.span.end_s, '.')}\n{cue}\n\n"
                                  for s, cue in _cues(segments))


def to_verbose_json(segments: list[TranscriptSegment], *, task: str, language: str | None, duration_s: float,
                    temperature: float, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "task": task,
        # the ISO-639-1 code the request named ("en" for a translation), else the language a speech recognizer
        # heard (its name, lower case, as OpenAI's shows it); a thinker names none
        "language": "en" if task == "translate" else (language.lower() if language else "unknown"),
        "duration": round(duration_s, 3),
        "text": joined_text(segments),
        "segments": [{
            "id": i,
            "seek": round(s.span.start_s * 100),
            "start": s.span.start_s,
            "end": s.span.end_s,
            "text": s.text.strip(),
            "tokens": [lp.token_id for lp in s.token_logprobs],
            "temperature": temperature,
            "avg_logprob": (sum(lp.logprob for lp in s.token_logprobs) / len(s.token_logprobs)
                            if s.token_logprobs else 0.0),
            "compression_ratio": compression_ratio(s.text.strip()),
            "no_speech_prob": round(1.0 - s.span.speech_prob, 6),
        } for i, s in enumerate(segments)],
        "usage": usage,
    }
