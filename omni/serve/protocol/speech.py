"""The speech request (OpenAI's openai/types/audio/speech_create_params.py), every field known."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from omni.serve.audio.time_stretch import MAX_SPEED, MIN_SPEED
from omni.serve.protocol.base import RequestModel, check_voice, voice_name

MAX_INPUT_CHARS = 4096  # OpenAI's limit on `input`


class SpeechRequest(RequestModel):
    """OpenAI's speech request (openai/types/audio/speech_create_params.py), every field known."""

    model: str = Field(description="The served model name.")
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS, description="The text to voice.")
    voice: Any = Field(description='The speaker (Qwen2.5-Omni: Chelsie or Ethan), or {"id": speaker} (OpenAI\'s '
                       "custom voices).")
    instructions: str | None = Field(None, description="How to say it: the thinker's system turn.")
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = Field(
        "mp3", description="The file format (OpenAI's default: mp3). aac has no encoder here.")
    speed: float | None = Field(None, description=f"The tempo, {MIN_SPEED}-{MAX_SPEED} (1: as voiced); the pitch "
                                "stays (WSOLA time stretch).")
    stream_format: Literal["sse", "audio"] = Field("audio", description="Raw bytes, or server-sent events.")

    @field_validator("voice")
    @classmethod
    def _voice(cls, v: Any) -> Any:
        return check_voice(v)

    @field_validator("response_format", "stream_format", mode="before")
    @classmethod
    def _null_is_the_default(cls, v: Any, info: Any) -> Any:
        """null is the field left out, as OpenAI takes it (typed clients send their unset fields as null)."""
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("speed")
    @classmethod
    def _speed(cls, v: float | None) -> float | None:
        if v is not None and not (MIN_SPEED <= v <= MAX_SPEED):  # NaN fails too
            raise ValueError(f"must be in [{MIN_SPEED}, {MAX_SPEED}] (1: as voiced)")
        return v

    @property
    def speaker(self) -> str:
        return voice_name(self.voice)

    @property
    def voice_field(self) -> str:
        return "voice.id" if isinstance(self.voice, dict) else "voice"
