"""The speech-to-text requests: `/v1/audio/transcriptions` and `/v1/audio/translations` forms (multipart fields,
OpenAI's openai/types/audio/transcription_create_params.py and translation_create_params.py)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from omni.serve.protocol.base import RequestModel, check_unsupported
from omni.serve.protocol.languages import check_language


class ServerVad(RequestModel):
    """OpenAI's chunking_strategy object (the realtime server VAD's parameters and defaults)."""

    model_config = ConfigDict(strict=False)  # a form's values are strings ("0.2")
    type: Literal["server_vad"]
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=10_000)
    silence_duration_ms: int = Field(500, ge=32, le=10_000)


class TranscriptionFormBase(RequestModel):
    # lax: a form's values are strings ("0.2", "true"); unknown fields are refused by name (the base's)
    model_config = ConfigDict(strict=False)

    model: str = Field(description="The served model name.")
    prompt: str | None = Field(None, max_length=4000, description="Text that guides the transcription.")
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = Field("json")
    temperature: float = Field(0.0, ge=0.0, le=1.0, description="0: greedy.")


class TranscriptionForm(TranscriptionFormBase):
    language: Annotated[str | None, AfterValidator(check_language)] = Field(
        None, description="ISO-639-1 code of the speech.")
    stream: bool = False
    include: list[Literal["logprobs"]] | None = Field(None, description="logprobs: each reply token's (json only).")
    timestamp_granularities: list[Literal["segment", "word"]] | None = Field(
        None, description="segment (verbose_json only); word timestamps are not produced.")
    chunking_strategy: Literal["auto"] | ServerVad | None = Field(
        None, description="Cut the clip at silences (voice activity) and transcribe each part.")
    # OpenAI's diarization options this server does not implement: accepted absent only
    known_speaker_names: list[str] | None = None
    known_speaker_references: list[str] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> "TranscriptionForm":
        check_unsupported(self, {"known_speaker_names": (None,), "known_speaker_references": (None,)})
        return self


class TranslationForm(TranscriptionFormBase):
    pass
