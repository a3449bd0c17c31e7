"""A `/v1/realtime` session's input audio: the buffer since the last commit or clear, on the session's audio clock
(every event's ms are on it), the G.711 upsampler of an 8 kHz input format, and the server VAD's detector.

Appended audio is brought to the protocol's rate (24 kHz) as it comes; a commit takes the buffer (from the turn's
speech start, with server VAD) and starts the next one. A detector is loaded when turn detection is on (it may be
unavailable: refused naming the setting) and sees the audio from the clock time it was loaded at.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
from typing import TYPE_CHECKING

import numpy as np

from omni.serve.audio import g711
from omni.serve.audio.codecs import pcm16_to_float
from omni.serve.audio.resampling import Resampler8k24k, resample
from omni.serve.protocol.realtime import RealtimeEventError
from omni.serve.realtime.conversation import new_item_id
from omni.serve.realtime.response import RATE

if TYPE_CHECKING:
    from omni.serve.audio.vad import TurnDetector, VadEvent, VadModels

MIN_COMMIT_MS = 100  # OpenAI's: a commit needs at least this much audio


def b64_bytes(data: str, param: str, event_id: str | None) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeEventError(f"{param}: not valid base64", param, "invalid_value", event_id) from None


class InputAudio:
    def __init__(self, max_samples: int, vad_models: VadModels):
        self.format = "audio/pcm"  # session.audio.input.format.type: pcm16 at 24 kHz, or G.711 at 8 kHz
        self.upsampler: Resampler8k24k | None = None  # G.711 brought to 24 kHz as it comes
        self.chunks: list[np.ndarray] = []  # float32 at 24 kHz since the last commit / clear
        self.samples = 0
        self.start_ms = 0.0  # session audio clock at the buffer's first sample
        self.pending_item_id = new_item_id()  # the id the buffer's item will have
        self.speech_start_ms: float | None = None
        self.vad: TurnDetector | None = None
        self.vad_offset_ms = 0.0  # the session audio clock when the detector started
        self.max_samples = max_samples
        self.vad_models = vad_models  # the server's: a detector's model is taken from it and given back

    @property
    def clock_ms(self) -> float:
        """The session audio clock at the end of the buffer."""
        return self.start_ms + self.samples * 1000 / RATE

    def set_format(self, fmt: str) -> None:
        if fmt != self.format:
            self.format = fmt
            self.upsampler = None if fmt == "audio/pcm" else Resampler8k24k(up=True)

    def decode(self, audio: str, event_id: str | None) -> np.ndarray:
        """An append's base64 audio as float32 at 24 kHz."""
        data = b64_bytes(audio, "audio", event_id)
        if self.upsampler is not None:  # G.711 at 8 kHz: one byte a sample, any length
            return self.upsampler.push(g711.decode(self.format, data))
        if len(data) % 2:
            raise RealtimeEventError(f"audio: pcm16 has 2 bytes per sample, got {len(data)} bytes", "audio",
                                     "invalid_value", event_id)
        return pcm16_to_float(data)

    def append(self, samples: np.ndarray, event_id: str | None) -> None:
        if self.samples + samples.size > self.max_samples:
            raise RealtimeEventError(f"audio: the input audio buffer would hold {self.samples + samples.size} "
                                     f"samples, more than the server's limit of {self.max_samples} "
                                     "(--max-media-mb); commit or clear it", "audio", "buffer_too_large", event_id)
        self.chunks.append(samples)
        self.samples += samples.size

    async def load_vad(self, event_id: str | None, clock_ms: float) -> None:
        """A detector for the audio from `clock_ms` on."""
        from omni.serve.audio.vad import TurnDetector, VadUnavailable

        try:
            model = await asyncio.to_thread(self.vad_models.take)
            self.vad, self.vad_offset_ms = TurnDetector(model=model), clock_ms
        except VadUnavailable as e:
            raise RealtimeEventError(str(e), "session.audio.input.turn_detection", "vad_unavailable",
                                     event_id) from None

    def drop_vad(self) -> None:
        """Turn detection off, or the session over: the detector's model goes back to the server's."""
        if self.vad is not None:
            vad, self.vad = self.vad, None
            self.vad_models.give(vad.model)

    async def detect(self, samples: np.ndarray) -> list[tuple[VadEvent, int]]:
        """The detector's events on `samples` (just appended), each with its time on the session clock."""
        assert self.vad is not None
        return [(ev, int(self.vad_offset_ms + ev.ms)) for ev in await asyncio.to_thread(self.vad.feed, samples)]

    def committable(self, event_id: str | None, trim_from_ms: float | None = None) -> np.ndarray:
        """The buffer's audio a commit takes (server VAD: from the turn's speech start, with its prefix padding);
        refused when shorter than MIN_COMMIT_MS."""
        audio = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        if trim_from_ms is not None:
            audio = audio[max(0, int((trim_from_ms - self.start_ms) * RATE / 1000)):]
        if audio.size < MIN_COMMIT_MS * RATE // 1000:
            raise RealtimeEventError(f"input_audio_buffer: {audio.size * 1000 / RATE:.0f} ms of audio, at least "
                                     f"{MIN_COMMIT_MS} ms are needed to commit", None,
                                     "input_audio_buffer_commit_empty", event_id)
        return audio

    def clear(self) -> None:
        """The next buffer starts where this one ended (committed, or cleared)."""
        self.start_ms += self.samples * 1000 / RATE
        self.chunks, self.samples, self.pending_item_id = [], 0, new_item_id()
        self.speech_start_ms = None

    def restart(self) -> None:
        """input_audio_buffer.clear: the cleared audio is not the next audio's past (upsampler, detector)."""
        self.clear()
        if self.upsampler is not None:
            self.upsampler = Resampler8k24k(up=True)
        if self.vad is not None:
            self.vad.reset()

    async def item_audio(self, audio: str, param: str, event_id: str | None, rate: int) -> np.ndarray:
        """A client item's whole input audio (base64 in the input format) at the model's `rate`, in one piece."""
        pcm = b64_bytes(audio, param, event_id)
        if self.format == "audio/pcm":
            return await asyncio.to_thread(resample, pcm16_to_float(pcm[: len(pcm) // 2 * 2]), RATE, rate)
        return await asyncio.to_thread(resample, g711.decode(self.format, pcm), g711.G711_RATE, rate)
