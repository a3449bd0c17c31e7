"""Voices uploaded to the server (`POST /v1/audio/voices`): reference clips a text-to-speech pipeline, or a voice
agent's speech stage (voices/choice.py), clones.

A voice is a clip of recorded speech and its transcript, kept by the server (in memory, bounded: MAX_VOICES voices
of at most MAX_SECONDS each) and named by the uploader. A speech request that names it (`voice: NAME` or
`{"id": NAME}`) hands the stage the clip as the request's reference voice: the stage encodes it once (by its hash)
and its blocks are a prefix the cache keeps, as for a voice its config names.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

MAX_VOICES = 32
MAX_SECONDS = 30.0
MAX_TEXT_CHARS = 2000
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class UploadedVoice:
    name: str
    wave: np.ndarray  # mono float32
    rate: int
    text: str  # the clip's transcript
    created_at: int
    file_size: int
    consent: str | None = None

    def card(self) -> dict:
        """The voice as the endpoints show it (vLLM-Omni's fields, plus its length)."""
        return {"name": self.name, "created_at": self.created_at, "file_size": self.file_size,
                "duration_s": round(self.wave.size / self.rate, 3), "consent": self.consent}


class VoiceUploadError(ValueError):
    """Why an upload is refused: the message names the field; `status` the HTTP status."""

    def __init__(self, message: str, field: str, status: int = 400, code: str = "invalid_value"):
        super().__init__(message)
        self.field, self.status, self.code = field, status, code


@dataclass
class UploadedVoices:
    max_voices: int = MAX_VOICES
    _voices: dict[str, UploadedVoice] = field(default_factory=dict)  # by name, lower case
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, wave: np.ndarray, rate: int, text: str, file_size: int, taken: tuple[str, ...] = (),
            consent: str | None = None) -> UploadedVoice:
        """Keep a voice; VoiceUploadError naming the field when it cannot be (`taken`: the pipeline's own names)."""
        if not NAME.match(name):
            raise VoiceUploadError(f"name: {name!r}: letters, digits, '_' and '-', 1 to 64 of them", "name")
        if name.lower() in (v.lower() for v in taken):
            raise VoiceUploadError(f"name: {name!r} is a voice of the pipeline's config; choose another name", "name",
                                   409, "already_exists")
        text = text.strip()
        if not text or len(text) > MAX_TEXT_CHARS:
            raise VoiceUploadError(f"ref_text: the clip's transcript, 1 to {MAX_TEXT_CHARS} characters (the model "
                                   "clones a voice from the clip and what it says)", "ref_text")
        seconds = wave.size / rate
        if not 0.5 <= seconds <= MAX_SECONDS:
            raise VoiceUploadError(f"audio_sample: {seconds:.2f} s of audio; a reference clip is 0.5 to "
                                   f"{MAX_SECONDS:g} s", "audio_sample")
        voice = UploadedVoice(name, np.ascontiguousarray(wave, dtype=np.float32), int(rate), text, int(time.time()),
                              file_size, consent)
        with self._lock:
            if name.lower() in self._voices:
                raise VoiceUploadError(f"name: a voice {name!r} was uploaded already; DELETE it first", "name", 409,
                                       "already_exists")
            if len(self._voices) >= self.max_voices:
                raise VoiceUploadError(f"audio_sample: this server keeps {self.max_voices} uploaded voices and holds "
                                       "that many; DELETE one first", "audio_sample", 429, "too_many_voices")
            self._voices[name.lower()] = voice
        return voice

    def get(self, name: str | None) -> UploadedVoice | None:
        return None if name is None else self._voices.get(name.lower())

    def remove(self, name: str) -> UploadedVoice | None:
        with self._lock:
            return self._voices.pop(name.lower(), None)

    def names(self) -> list[str]:
        return [v.name for v in self._voices.values()]

    def cards(self) -> list[dict]:
        return [v.card() for v in self._voices.values()]
