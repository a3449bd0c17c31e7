"""ServeSettings: how `omni serve` listens and what it accepts (the pipeline itself is the YAML config)."""
from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni.serve.generation.tool_parser import PARSERS as TOOL_CALL_PARSERS

API_KEY_ENV = "OMNI_API_KEY"
_MB = 2**20


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address to bind; 127.0.0.1 unless told otherwise "
                      "(0.0.0.0 exposes the server to the network).")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port).")
    api_key: str | None = Field(None, min_length=1, description="When set, /v1/* requires "
                                "`Authorization: Bearer <key>` (401 otherwise). Default: $OMNI_API_KEY.")
    served_model_name: str | None = Field(None, min_length=1, description="The model name clients send; "
                                          "default: the pipeline's name.")
    max_body_bytes: int = Field(32 * _MB, ge=1024, description="Largest request body (413 past it).")
    max_media_items: int = Field(8, ge=0, description="Images + audio clips per request (413 past it).")
    max_media_bytes: int = Field(64 * _MB, ge=1, description="Largest decoded image (RGB bytes) or audio "
                                 "clip (float32 bytes), checked from its header before decoding (413 past it).")
    audio_input_rate: int = Field(16000, ge=1, description="Sampling rate the model's audio encoder expects; "
                                  "input audio is resampled to it (Qwen2.5-Omni's Whisper encoder: 16000).")
    audio_chunk_ms: float = Field(100.0, gt=0, description="Length of each streamed audio chunk cut "
                                  "from a waveform the pipeline hands over whole.")
    default_audio_rate: int = Field(24000, ge=1, description="Rate of pipeline audio that does not say its own "
                                    "(its passthrough sampling_rate).")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 503 (runtime.max_pending_requests reached).")
    shutdown_grace_s: float = Field(10.0, ge=0, description="On SIGTERM / Ctrl-C: how long requests in flight "
                                    "may run on (new ones get 503) before each is ended with an error.")
    log_level: str = Field("info", description="uvicorn's log level.")
    max_sessions: int = Field(16, ge=1, description="Concurrent /v1/realtime sessions; one more is answered "
                              "with an error event and closed with code 1013 (try again later).")
    session_idle_timeout_s: float = Field(600.0, gt=0, description="A /v1/realtime session that receives no "
                                          "client event for this long is closed with a reason (code 1000).")
    max_session_responses: int = Field(4, ge=1, description="Responses one /v1/realtime session runs at once "
                                       "(its conversation's and the out-of-band ones); one more is an error event.")
    max_conversation_items: int = Field(1024, ge=1, description="Items a /v1/realtime session's conversation holds; "
                                        "one more is an error event (delete items to go on).")
    max_conversation_bytes: int = Field(64 * _MB, ge=1024, description="Bytes a /v1/realtime session's conversation "
                                        "holds (text, audio at the model's rate, images); an item past it is an "
                                        "error event.")

    default_modalities: tuple[Literal["text", "audio"], ...] = Field(
        ("text",), min_length=1, description="A chat request's output modalities when it names none: text (OpenAI's "
        "default), or text and audio (vLLM-Omni's; audio only where the pipeline speaks).")
    voice_map: dict[str, str] = Field(default_factory=dict, description="OpenAI voice names -> the pipeline's voices "
                                      "(alloy=Chelsie, ...); empty: OpenAI's names are refused, naming this option.")

    enable_auto_tool_choice: bool = Field(False, description='Chat\'s tool_choice "auto" (the default when a '
                                          'request has tools): the reply is read for tool calls in the model\'s own '
                                          'format (tool_call_parser); off, "auto" is refused (vLLM\'s flag).')
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = Field(None, description="The model's tool-call format for "
                                                       '"auto" (omni/serve/generation/tool_parser.py): hermes, as '
                                                       "Qwen2.5 / Qwen3 chat templates ask for.")

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> "ServeSettings":
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format: "
                             "hermes)")
        return self

    @classmethod
    def from_env(cls, **kw: object) -> "ServeSettings":
        """Settings with the API key from $OMNI_API_KEY unless given (None values are left out)."""
        values = {k: v for k, v in kw.items() if v is not None}
        if "api_key" not in values and os.environ.get(API_KEY_ENV):
            values["api_key"] = os.environ[API_KEY_ENV]
        return cls(**values)
