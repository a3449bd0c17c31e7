"""The Realtime protocol's client events as `omni serve` accepts them (GA names, as the `openai` client's
`client.realtime.connect()` sends them: openai/types/realtime/*_event_param.py), checked at the edge.

    parse_client_event(text) -> ClientEvent      or RealtimeEventError(message, param, code, event_id)

Unknown event types, unknown fields and fields this server does not implement (an MCP tool, noise reduction,
a speed outside 0.25-1.5, ...) are refused naming the field (`param`, the path inside the
event: `session.audio.input.format.type`); null or an absent field asks for nothing. Refusals are error
events: the session stays open.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from omni.config.pydantic_errors import loc_to_param
from omni.serve.protocol.base import RequestModel, unsupported
from omni.serve.protocol.languages import check_language


class RealtimeEventError(Exception):
    """A client event refused: becomes an `error` event (of type `kind`) naming `param`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 event_id: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.event_id, self.kind = message, param, code, event_id, kind


class RealtimeModel(RequestModel):
    """A Realtime event's part. Pydantic's lax mode, as the events have always been read (a whole-number float for
    an int, say); unknown fields are still refused. UNSUPPORTED: the fields this server does not implement -> the
    values that ask for nothing (any other is refused naming the field)."""

    model_config = ConfigDict(strict=False)
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @field_validator("*")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        accepted = cls.UNSUPPORTED.get(info.field_name or "")
        why = None if accepted is None else unsupported(v, accepted)
        if why is not None:
            raise ValueError(why)
        return v


REALTIME_MIN_SPEED, REALTIME_MAX_SPEED = 0.25, 1.5  # session.audio.output.speed, as OpenAI's Realtime API


# ------------------------------------------------------------------ session
class AudioFormat(RealtimeModel):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = Field(
        "audio/pcm", description="pcm16 at 24 kHz mono, or G.711 (mu-law / A-law) at 8 kHz (audio/g711.py).")
    rate: Literal[24000] | None = Field(None, description="audio/pcm only: 24000.")

    @model_validator(mode="after")
    def _rate_for_pcm_only(self) -> "AudioFormat":
        if self.rate is not None and self.type != "audio/pcm":
            raise ValueError(f"rate: {self.type} is 8 kHz and takes no rate")
        return self


class TurnDetection(RealtimeModel):
    type: Literal["server_vad"] = Field(description="server_vad (semantic_vad is not supported).")
    threshold: float | None = Field(None, ge=0.0, le=1.0, description="Speech probability that starts speech.")
    prefix_padding_ms: int | None = Field(None, ge=0, le=5000)
    silence_duration_ms: int | None = Field(None, ge=0, le=10000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: int | None = None
    UNSUPPORTED = {"idle_timeout_ms": (None,)}


class Transcription(RealtimeModel):
    model: str | None = Field(None, min_length=1, description="Any name (OpenAI's clients send whisper-1, "
                              "gpt-4o-transcribe, ...): the pipeline's own text stage transcribes.")
    language: Annotated[str | None, AfterValidator(check_language)] = Field(
        None, description="ISO-639-1 code of the speech.")
    prompt: str | None = Field(None, max_length=4000, description="Text that guides the transcription.")


class AudioInput(RealtimeModel):
    format: AudioFormat | None = None
    turn_detection: TurnDetection | None = Field(None, description="null: manual turns (commit + response.create).")
    transcription: Transcription | None = Field(None, description="Transcribe each committed audio item "
                                                "(realtime/transcription.py); null: no transcription.")
    noise_reduction: Any = None
    UNSUPPORTED = {"noise_reduction": (None,)}


class VoiceRef(RealtimeModel):
    id: str


class AudioOutput(RealtimeModel):
    format: AudioFormat | None = None
    voice: str | VoiceRef | None = None
    speed: float | None = None

    @field_validator("speed")
    @classmethod
    def _speed(cls, v: Any) -> Any:
        # OpenAI's Realtime range: the tempo of the reply's audio, its pitch kept (audio/time_stretch.py)
        if v is not None and not (REALTIME_MIN_SPEED <= v <= REALTIME_MAX_SPEED):  # NaN fails too
            raise ValueError(f"must be in [{REALTIME_MIN_SPEED}, {REALTIME_MAX_SPEED}] (1: as voiced)")
        return v


class AudioConfig(RealtimeModel):
    input: AudioInput | None = None
    output: AudioOutput | None = None


class RealtimeTool(RealtimeModel):
    """A function the model may call (the Realtime API's flat shape: no nested `function`)."""

    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        """The tool as chat templates (and chat completions' `tools`) hold it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


class FunctionChoice(RealtimeModel):
    """tool_choice naming the function the reply must call."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


def _max_output_tokens(v: Any) -> Any:
    if isinstance(v, int) and not 1 <= v <= 4096:
        raise ValueError("an integer in 1..4096 or 'inf'")
    return v


def _tool_choice(v: Any) -> Any:
    # "required" and a named function constrain the reply to a call (structured outputs, as chat completions)
    if v is None or v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function":
        return FunctionChoice.model_validate(v)
    raise ValueError('"auto", "none", "required" or {"type": "function", "name": ...} (MCP tools are not served)')


# Fields the session and a response share, checked the same way in both
MaxOutputTokens = Annotated[int | Literal["inf"] | None, AfterValidator(_max_output_tokens)]
ToolChoice = Annotated[Any, AfterValidator(_tool_choice)]


def forced_tool(choice: str | FunctionChoice | None) -> str | None:
    """What a reply must be: "required" (calls of any tools), a function's name, or None (text or calls)."""
    if isinstance(choice, FunctionChoice):
        return choice.name
    return "required" if choice == "required" else None


class SessionConfig(RealtimeModel):
    type: Literal["realtime"] | None = None
    model: str | None = None
    instructions: str | None = None
    output_modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1, max_length=1)
    audio: AudioConfig | None = None
    max_output_tokens: MaxOutputTokens = None
    tools: list[RealtimeTool] | None = Field(None, max_length=128, description="Functions the model may call "
                                             "(the reply is read for Hermes calls: realtime/response.py).")
    tool_choice: ToolChoice = Field(None, description='auto (default), none, required or {"type": "function", '
                                    '"name"}.')
    tracing: Any = None
    truncation: Any = None
    include: Any = None
    prompt: Any = None
    UNSUPPORTED = {"tracing": (None,), "truncation": (None, "auto", "disabled"), "include": (None, []),
                   "prompt": (None,)}


# ------------------------------------------------------------------- items
class ContentPart(RealtimeModel):
    type: Literal["input_text", "input_audio", "input_image", "text", "output_text", "output_audio"]
    text: str | None = None
    audio: str | None = Field(None, description="base64 pcm16 at 24 kHz (input_audio).")
    transcript: str | None = None
    image_url: str | None = Field(None, description="input_image: a data: URL, data:image/png;base64,... (PNG, "
                                  "JPEG, WEBP, GIF, BMP; the server fetches nothing).")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="input_image: accepted; the model's "
                                                          "own resolution rules apply.")


class Item(RealtimeModel):
    id: str | None = Field(None, max_length=64)
    type: Literal["message"] = "message"
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart] = Field(min_length=1)


class FunctionCallItem(RealtimeModel):
    """A call the model made (a client may replay one into a conversation)."""

    id: str | None = Field(None, max_length=64)
    type: Literal["function_call"]
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    call_id: str = Field(min_length=1, max_length=64)
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(description="The call's arguments, JSON text.")


class FunctionCallOutputItem(RealtimeModel):
    """What a call returned: the client ran the function."""

    id: str | None = Field(None, max_length=64)
    type: Literal["function_call_output"]
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    call_id: str = Field(min_length=1, max_length=64)
    output: str


def _item_kind(v: Any) -> str:
    return (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) or "message"


AnyItem = Annotated[Annotated[Item, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                    Discriminator(_item_kind, custom_error_type="invalid_item_type",
                                  custom_error_message="type: message, function_call or function_call_output")]
ITEM_TAGS = frozenset({"message", "function_call", "function_call_output"})


# --------------------------------------------------------------- responses
class ResponseAudio(RealtimeModel):
    output: AudioOutput | None = None


class ResponseParams(RealtimeModel):
    output_modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1, max_length=1)
    instructions: str | None = None
    max_output_tokens: MaxOutputTokens = None
    audio: ResponseAudio | None = None
    conversation: Literal["auto", "none"] | None = Field(
        None, description='"none": an out-of-band response, kept out of the conversation (it may run beside the '
        "conversation's own response).")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Echoed in the response's events.")
    tools: list[RealtimeTool] | None = Field(None, max_length=128, description="This response's tools (else the "
                                             "session's).")
    tool_choice: ToolChoice = None
    input: list[dict[str, Any]] | None = Field(
        None, description="The response's own context instead of the conversation: items, or "
        '{"type": "item_reference", "id"} of the conversation\'s ([]: nothing but the instructions).')
    prompt: Any = None
    UNSUPPORTED = {"prompt": (None,)}


# ------------------------------------------------------------------ events
class _Event(RealtimeModel):
    event_id: str | None = Field(None, max_length=256)


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionConfig


class AudioAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: AnyItem


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = Annotated[SessionUpdate | AudioAppend | AudioCommit | AudioClear | ItemCreate | ItemDelete
                        | ItemTruncate | ItemRetrieve | ResponseCreate | ResponseCancel, Field(discriminator="type")]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(ClientEvent)
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "VoiceRef"}) | ITEM_TAGS
EVENT_TYPES = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
               "input_audio_buffer.clear", "conversation.item.create", "conversation.item.delete",
               "conversation.item.truncate", "conversation.item.retrieve", "response.create", "response.cancel")


def parse_client_event(text: str | bytes) -> Any:
    """One client message -> its event model; RealtimeEventError naming the field otherwise."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise RealtimeEventError(f"the message is not JSON: {e}", code="invalid_json") from None
    except RecursionError:  # nested deeper than the decoder goes (a hostile or broken client)
        raise RealtimeEventError("the message is JSON nested too deeply to read", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise RealtimeEventError("an event is a JSON object with a `type`", code="invalid_event")
    event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
    kind = raw.get("type")
    if kind not in EVENT_TYPES:
        raise RealtimeEventError(f"type: unknown or unsupported event type {kind!r}; this server takes "
                                 f"{', '.join(EVENT_TYPES)}", "type", "invalid_event", event_id)
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as err:
        errors = err.errors()
        e = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
        # [0] is the event's tag; union members' names (`voice: str | VoiceRef`) are not fields
        loc = tuple(p for p in e["loc"][1:] if p not in _UNION_MEMBERS)
        param = loc_to_param(loc, frozenset(EVENT_TYPES)) or None
        if e["type"] == "extra_forbidden":
            raise RealtimeEventError(f"Unknown parameter: {param}", param, "unknown_parameter", event_id) from None
        if e["type"] == "missing":
            raise RealtimeEventError(f"{param}: required field is missing", param, "missing_required_parameter",
                                     event_id) from None
        msg = e["msg"].removeprefix("Value error, ")
        raise RealtimeEventError(f"{param}: {msg}" if param else msg, param, "invalid_value", event_id) from None
