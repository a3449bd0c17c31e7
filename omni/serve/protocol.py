"""The OpenAI request shapes `omni serve` accepts (pydantic at the edge, unknown fields refused).

Chat completions and completions as OpenAI documents them, plus the extensions vLLM / vLLM-Omni
clients send in `extra_body`: `sampling_params_list` (one entry per stage, config order),
`cache_salt`, `top_k`, `min_p`, `ignore_eos`, `min_tokens`, `repetition_penalty`, `stop_token_ids`.
OpenAI's `presence_penalty`, `frequency_penalty`, `logit_bias` and `logprobs` apply to the text stage
(vLLM's semantics).

Every field of OpenAI's request schemas is known (openai/types/chat/completion_create_params.py and
completion_create_params.py). A field this server does not implement (tools, suffix,
...) is accepted when it asks for nothing: null, or its default value (`"logprobs": false`,
`"tool_choice": null`), as clients that serialise their unset
fields send them; any other value is a 400 naming it (code `unsupported_parameter`), never silently
ignored. vLLM's own request fields are known the same way (_VLLM_UNSUPPORTED: what clients written for vLLM
send, often at their defaults), or taken (truncate_prompt_tokens, chat_template_kwargs, guided_json, request_id,
stream_options.continuous_usage_stats, ...). A field neither has is a 400 (`unknown_parameter`), as OpenAI's.
Integer fields take whole-number floats (5.0), as vLLM's lax pydantic does; strings and booleans stay refused.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from omni.errors import FIELD_ERROR
from omni.config.pydantic_errors import accepts, shown


def field_error(field: str, text: str, code: str = "invalid_value") -> PydanticCustomError:
    """A model validator's error naming its field (and code) as data (errors.from_validation_error reads it)."""
    return PydanticCustomError(FIELD_ERROR, "{field}: {text}", {"field": field, "text": text, "code": code})


def _same(value: Any, accepted: Any) -> bool:
    """JSON equality without Python's bool/int mixing (`false` is not 0) and with 0 == 0.0."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    return value == accepted and type(value) in (type(accepted), int, float)


# OpenAI fields this server does not implement -> the values that ask for nothing (null first, then the
# default). Anything else is refused naming the field.
_CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "moderation": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "prompt_cache_options": (None,),
    "prompt_cache_retention": (None,),
}
_COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}
# vLLM's own request fields (vllm/entrypoints/openai/protocol.py) that clients written for vLLM send, often at
# their defaults: known here, so that they are accepted at those values and refused by name otherwise, as OpenAI's
# (guided_json / guided_regex / guided_choice, vLLM's older spelling of structured outputs, are taken: translate.py)
_VLLM_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "priority": (None, 0),  # vLLM refuses a priority unless its scheduler is started with priority scheduling
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "structural_tag": (None,),
    "guided_grammar": (None,),
    "guided_whitespace_pattern": (None,),
    "vllm_xargs": (None,),
    "kv_transfer_params": (None,),
    "mm_processor_kwargs": (None, {}),
    "prompt_embeds": (None,),
}
_VLLM_CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "add_special_tokens": (None, False),
    "chat_template": (None,),
    "documents": (None,),
    "media_io_kwargs": (None, {}),
}


def _check_unsupported(req: BaseModel, table: dict[str, tuple[Any, ...]]) -> None:
    for name, accepted in table.items():
        value = getattr(req, name)
        if not any(_same(value, a) for a in accepted):
            nothing = ", ".join("null" if a is None else json.dumps(a) for a in accepted)
            raise field_error(name, f"this server does not implement it: send it absent or as {nothing} "
                              f"(got {shown(value)})", "unsupported_parameter")


class _Strict(BaseModel):
    # strict: no "0.5" for a number, no true for an int; JSON ints are still accepted for floats
    model_config = ConfigDict(extra="forbid", strict=True)


def whole_number(v: Any) -> Any:
    """A JSON number with no fraction (5.0, 1e2) taken for an integer field, as vLLM's (lax) pydantic takes it:
    JavaScript and YAML clients write numbers as floats. Strings and booleans stay refused."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


# ------------------------------------------------------------------- content
class TextPart(_Strict):
    type: Literal["text"] = Field(description="A text part.")
    text: str = Field(description="The text.")


class ImageURL(_Strict):
    url: str = Field(description="A data: URL, data:image/png;base64,... (PNG, JPEG, WEBP, GIF, BMP).")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="Accepted; the model's own "
                                                           "resolution rules apply.")


class ImagePart(_Strict):
    type: Literal["image_url"] = Field(description="An image part.")
    image_url: ImageURL = Field(description="The image.")


class InputAudio(_Strict):
    data: str = Field(description="The audio file, base64.")
    format: Literal["wav", "mp3", "flac", "ogg"] = Field(description="Its container format.")


class InputAudioPart(_Strict):
    type: Literal["input_audio"] = Field(description="An audio part (OpenAI's shape).")
    input_audio: InputAudio = Field(description="The audio.")


class AudioURL(_Strict):
    url: str = Field(description="A data: URL, data:audio/wav;base64,...")


class AudioURLPart(_Strict):
    type: Literal["audio_url"] = Field(description="An audio part (vLLM's shape).")
    audio_url: AudioURL = Field(description="The audio.")


ContentPart = Annotated[TextPart | ImagePart | InputAudioPart | AudioURLPart, Field(discriminator="type")]
PART_TAGS = frozenset({"text", "image_url", "input_audio", "audio_url"})  # dropped from error paths


class AssistantAudio(_Strict):
    """An earlier spoken reply: by id (OpenAI's pattern; the server puts its transcript back, audio_ids.py), or
    the reply's own `message.audio` sent back whole (its transcript is used; the audio data is not read)."""

    id: str = Field(description="The id of an earlier reply's audio.")
    data: str | None = Field(None, description="Accepted (the reply's audio, sent back); not read.")
    expires_at: int | None = Field(None, description="Accepted; not read.")
    transcript: str | None = Field(None, description="The reply's text: the assistant turn's content when the "
                                   "message has none.")


class FunctionCall(_Strict):
    name: str = Field(min_length=1, description="The function called.")
    arguments: str = Field(description="Its arguments: a JSON object, as text.")


class ToolCall(_Strict):
    id: str = Field(min_length=1, description="The call's id (a tool message answers it by tool_call_id).")
    type: Literal["function"] = Field(description="function.")
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Who speaks.")
    content: list[ContentPart] | None = Field(
        None, description="Text, or a list of text / image_url / input_audio / audio_url parts.")
    name: str | None = Field(None, description="Accepted; not shown to the model.")
    audio: AssistantAudio | None = Field(None, description="An assistant turn's earlier audio reply (by id).")
    # What the openai client's ChatCompletionMessage carries when a reply is appended to the conversation as is.
    refusal: str | None = Field(None, description="Accepted (a reply's refusal, sent back); not shown to the model.")
    annotations: list[Any] | None = Field(None, description="Accepted (a reply's annotations, sent back); not read.")
    function_call: None = Field(None, description="Accepted when null (a reply's deprecated field, sent back).")
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's calls of the request's tools.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise field_error("tool_calls", f"only an assistant message makes tool calls, not a {self.role} one")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise field_error("tool_call_id", "a tool message needs the tool_call_id it answers" if self.role == "tool"
                              else f"only a tool message answers a call, not a {self.role} one")
        for k, call in enumerate(self.tool_calls or []):
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise field_error(f"tool_calls[{k}].function.arguments", "must be a JSON object, as text")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_is_one_part(cls, v: Any) -> Any:
        return [{"type": "text", "text": v}] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is not None and not self.content:
            # OpenAI refuses it (400, empty_array) rather than read it as no message: so does this server
            raise field_error("content", "empty array: expected text or at least one content part", "empty_array")
        if self.audio is not None and self.role != "assistant":
            raise field_error("audio", f"only an assistant message refers to an earlier audio reply, not a {self.role} "
                              "one")
        if self.content is None and self.audio is not None and self.audio.transcript is not None:
            self.content = [TextPart(type="text", text=self.audio.transcript)]
        if self.content is None and (self.tool_calls or self.audio is not None):
            return self  # an assistant turn that only called tools, or an audio reply by id (endpoints: its transcript)
        if self.content is None:
            raise field_error("content", "required (text or a list of content parts)")
        if self.role != "user" and any(p.type != "text" for p in self.content):
            raise field_error("content", f"images and audio go in user messages, not in a {self.role} message")
        return self


# ------------------------------------------------------------------ tools
class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="The function's name.")
    description: str | None = Field(None, description="What it does (the chat template shows it to the model).")
    parameters: dict[str, Any] | None = Field(None, description="Its arguments: a JSON schema of an object.")
    strict: bool | None = Field(None, description="Accepted: forced calls always follow the schema here.")


class ToolDef(_Strict):
    type: Literal["function"] = Field(description="function.")
    function: FunctionDef


class FunctionName(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"] = Field(description="function.")
    function: FunctionName


# ------------------------------------------------------------------ requests
class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send one more chunk with the usage before [DONE].")
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk also carries "
                                         "the usage so far.")


def check_voice(v: Any) -> Any:
    """A voice as OpenAI's chat and speech endpoints take it: a speaker's name, or {"id": name}. One field checked
    here, not a union: an error names the voice field, never a union member."""
    if not ((isinstance(v, str) and v) or (isinstance(v, dict) and set(v) == {"id"} and isinstance(v["id"], str)
                                           and v["id"])):
        raise ValueError('a speaker\'s name, or {"id": name}')
    return v


def voice_name(v: Any) -> str | None:
    """The speaker a checked voice names (None: none given)."""
    return v["id"] if isinstance(v, dict) else v


class AudioOutput(_Strict):
    voice: Any = Field(None, description='The speaker (Qwen2.5-Omni: Chelsie or Ethan), or {"id": speaker} (OpenAI\'s '
                       "custom voices, as the speech endpoint takes it); None: the pipeline's default.")

    @field_validator("voice")
    @classmethod
    def _voice(cls, v: Any) -> Any:
        return v if v is None else check_voice(v)

    @property
    def speaker(self) -> str | None:
        return voice_name(self.voice)

    @property
    def voice_field(self) -> str:
        return "audio.voice.id" if isinstance(self.voice, dict) else "audio.voice"

    # OpenAI's chat audio formats; which of mp3 / flac / opus this server encodes is asked of libsndfile at
    # request time (speech_formats.encodable), aac never: a 400 naming audio.format.
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"] = Field(
        "wav", description="wav, mp3, flac, opus (where the installed libsndfile encodes them) or pcm16 (16-bit "
        "little-endian mono at the pipeline's rate; required when streaming).")


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64, description="The schema's name (OpenAI requires one).")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the reply follows.")
    description: str | None = Field(None, description="Accepted; not used.")
    strict: bool | None = Field(None, description="Accepted: the reply always follows the schema (a grammar "
                                "constrains every token).")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = Field(description="text (default), json_object (any "
                                                                 "JSON object) or json_schema.")
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema: the schema.")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise field_error("json_schema", "type json_schema needs json_schema.schema")  # under response_format
        if self.type != "json_schema" and self.json_schema is not None:
            raise field_error("json_schema", f"only with type json_schema (got type {self.type})")
        return self

    @property
    def structured_outputs(self) -> dict[str, Any] | None:
        """SamplingParams.structured_outputs of this format (None: plain text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            assert self.json_schema is not None
            return {"json": self.json_schema.schema_}
        return None


class _Common(_Strict):
    """Fields chat completions and completions share."""

    model: str = Field(description="The served model name (the pipeline's name unless --served-model-name).")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most (the text stage).")
    temperature: float | None = Field(None, ge=0, le=2, description="0..2; 0 is greedy (the text stage).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling, (0, 1] (the text stage).")
    top_k: int | None = Field(None, ge=-1, description="Top-k sampling; 0 or -1: off (the text stage).")
    seed: int | None = Field(None, description="Per-request seed (the text stage).")
    stop: Annotated[str | list[str] | None, accepts("a string or a list of up to 16 strings")] = Field(
        None, description="Up to 16 strings that end the text (not included).")
    n: int | None = Field(None, ge=1, le=128, description="Number of choices (1-128, as OpenAI): each its own "
                          "request through the pipeline; with a seed, choice i samples with seed + i.")
    stream: bool | None = Field(None, description="Reply as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options (stream only).")
    user: str | None = Field(None, description="Accepted; not used.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="-2..2: minus this times a token's "
                                            "count in the output so far (the text stage).")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="-2..2: minus this for every token "
                                           "the output so far holds (the text stage).")
    min_p: float | None = Field(None, ge=0, le=1, description="Min-p sampling, 0..1; 0: off (the text stage).")
    logit_bias: dict[int, float] | None = Field(None, description="Token id (a JSON string key) -> bias in "
                                                "[-100, 100] added to its logit (the text stage).")
    ignore_eos: bool | None = Field(None, description="Keep generating past end-of-sequence (the text stage).")
    min_tokens: int | None = Field(None, ge=0, description="Tokens to generate before end-of-sequence or a stop "
                                   "token may be sampled, <= max_tokens (the text stage).")
    repetition_penalty: float | None = Field(None, gt=0, description="HF repetition penalty (the text stage).")
    stop_token_ids: list[int] | None = Field(None, description="Extra token ids that end the text stage.")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM's: the text keeps the stop string "
                                                    "that ended it (the text stage).")
    skip_special_tokens: bool | None = Field(None, description="vLLM's: false keeps special tokens in the text "
                                             "(the text stage).")
    spaces_between_special_tokens: bool | None = Field(
        None, description="vLLM's (the text stage): accepted; with the fast tokenizers omni loads it changes "
        "nothing, as with vLLM's fast detokenizer.")
    truncate_prompt_tokens: int | None = Field(
        None, description="vLLM's: keep only the last k prompt tokens (k >= 1; -1: max_model_len), the prompt "
        "the entry stage takes (one that renders its own prompt refuses one that would have to be cut).")
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "text"} (default), {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name", "schema"}}: the reply constrained to JSON (the text stage; structured outputs).')
    guided_json: Any = Field(None, description="vLLM's older spelling of structured_outputs {\"json\": schema}.")
    guided_regex: str | None = Field(None, description="vLLM's older spelling of structured_outputs {\"regex\"}.")
    guided_choice: list[str] | None = Field(None, description="vLLM's older spelling of structured_outputs "
                                            "{\"choice\"}.")
    guided_decoding_backend: str | None = Field(None, description="vLLM's: accepted; llguidance compiles every "
                                                "grammar here.")
    guided_grammar: Any = Field(None, description="vLLM's: not implemented (null).")
    guided_whitespace_pattern: Any = Field(None, description="vLLM's: not implemented (null).")
    request_id: str | None = Field(None, min_length=1, description="vLLM's: the request's id (the response's id "
                                   "is made from it; the server makes one when absent).")
    priority: int | None = Field(None, description="vLLM's: 0 (no priority scheduling here).")
    use_beam_search: Any = Field(None, description="vLLM's: not implemented (null or false).")
    length_penalty: Any = Field(None, description="vLLM's: not implemented (null or 1.0).")
    allowed_token_ids: Any = Field(None, description="vLLM's: not implemented (null); use logit_bias.")
    bad_words: Any = Field(None, description="vLLM's: not implemented (null or []); use logit_bias -100.")
    logits_processors: Any = Field(None, description="vLLM's: not implemented (null).")
    return_tokens_as_token_ids: Any = Field(None, description="vLLM's: not implemented (null or false).")
    return_token_ids: Any = Field(None, description="vLLM's: not implemented (null or false).")
    structural_tag: Any = Field(None, description="vLLM's: not implemented (null).")
    vllm_xargs: Any = Field(None, description="vLLM's: not implemented (null).")
    kv_transfer_params: Any = Field(None, description="vLLM's: not implemented (null).")
    mm_processor_kwargs: Any = Field(None, description="vLLM's: not implemented (null or {}).")
    prompt_embeds: Any = Field(None, description="vLLM's: not implemented over HTTP (null); the Python API takes "
                               "prompt_embeds.")
    sampling_params_list: list[dict[str, Any] | None] | None = Field(
        None, description="One entry per stage in config order (vLLM-Omni): SamplingParams fields merged over "
        "that stage's defaults, or null. The top-level fields above then apply to the text stage.")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="vLLM's prompt_logprobs (the text stage, not streamed): each choice's "
        "`prompt_logprobs`, per prompt token (null for the first) {token id: {logprob, rank, decoded_token}} of the "
        "token itself and the prompt_logprobs most likely ones. The prompt is recomputed (no prefix-cache hit).")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's structured outputs (the text stage): exactly one of {\"json\": schema}, "
        "{\"json_object\": true}, {\"regex\": str}, {\"choice\": [str, ...]}.")
    cache_salt: str | None = Field(
        None, min_length=1, description="Prefix-cache isolation: requests only share cached blocks with requests "
        "of the same salt (one tenant's prefix cache, and its timing side channel, stays its own).")

    _whole = field_validator("max_tokens", "n", "top_k", "seed", "min_tokens", "prompt_logprobs",
                             "truncate_prompt_tokens", "priority", mode="before")(classmethod(
        lambda cls, v: whole_number(v)))

    @model_validator(mode="after")
    def _vllm_unsupported(self) -> "_Common":
        _check_unsupported(self, _VLLM_UNSUPPORTED)
        return self

    @field_validator("temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("expected up to 16 non-empty strings")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_Common":
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise field_error("prompt_logprobs", "not with stream: true (the prompt's logprobs come with the reply)")
        return self

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats (with include_usage): every chunk carries the usage so far."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens.")
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, min_length=1, description='What to reply with: ["text"] (default) or ["text", "audio"].')
    audio: AudioOutput | None = Field(None, description="Audio reply options (with modalities audio).")
    # OpenAI's fields this server does not implement (see _CHAT_UNSUPPORTED for what each accepts) and
    # ones it takes as hints with no effect here (metadata, prompt_cache_key, safety_identifier).
    logprobs: bool | None = Field(None, description="Return each reply token's log-probability (the text stage).")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: also the 0..20 most likely "
                                     "tokens at each position.")
    tools: list[ToolDef] | None = Field(None, description="Functions the model may call: shown to it through the "
                                        "text stage's chat template.")
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None, accepts(
        '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')] = Field(
        None, description='"required" (one call or more of the tools) or {"type": "function", "function": {"name"}} '
        '(that one): the reply is constrained to the call\'s JSON (structured outputs) and comes back as '
        '`tool_calls`; "none": a text reply; "auto" (the default with tools): text or calls, read from the reply '
        'in the model\'s own format (a server started with --enable-auto-tool-choice --tool-call-parser, as vLLM).')
    parallel_tool_calls: bool | None = Field(None, description='With "required": false allows one call only.')
    functions: Any = Field(None, description="Not implemented: null or [].")
    function_call: Any = Field(None, description='Not implemented: null, "none" or "auto".')
    prediction: Any = Field(None, description="Not implemented: null.")
    reasoning_effort: Any = Field(None, description="Not implemented: null.")
    verbosity: Any = Field(None, description="Not implemented: null.")
    web_search_options: Any = Field(None, description="Not implemented: null.")
    moderation: Any = Field(None, description="Not implemented: null.")
    service_tier: Any = Field(None, description='Not implemented: null, "auto" or "default".')
    store: Any = Field(None, description="Not implemented: null or false.")
    prompt_cache_options: Any = Field(None, description="Not implemented: null.")
    prompt_cache_retention: Any = Field(None, description="Not implemented: null.")
    metadata: dict[str, str] | None = Field(None, description="Accepted; not used (nothing is stored).")
    prompt_cache_key: str | None = Field(None, description="Accepted; the prefix cache needs no key.")
    safety_identifier: str | None = Field(None, description="Accepted; not used.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: extra variables for the text stage's chat template (enable_thinking, ...); a "
        "template that does not use one ignores it, as Jinja does; a stage that renders its own prompt (the omni "
        "thinkers) uses none.")
    echo: Any = Field(None, description="vLLM's: not implemented for chat (null or false).")
    add_generation_prompt: Any = Field(None, description="vLLM's: not implemented (null or true).")
    continue_final_message: Any = Field(None, description="vLLM's: not implemented (null or false).")
    add_special_tokens: Any = Field(None, description="vLLM's: not implemented for chat (null or false).")
    chat_template: Any = Field(None, description="vLLM's: not implemented (null): the stage's own template.")
    documents: Any = Field(None, description="vLLM's: not implemented (null).")
    media_io_kwargs: Any = Field(None, description="vLLM's: not implemented (null or {}).")
    omni_stream_format: Literal["openai", "vllm-omni"] = Field(
        "openai", description="Streaming audio: openai sends it in delta.audio.data; vllm-omni sends each "
        "chunk with a top-level modality ('text' or 'audio') and the audio's base64 in delta.content.")

    @model_validator(mode="after")
    def _unsupported(self) -> "ChatCompletionRequest":
        _check_unsupported(self, _CHAT_UNSUPPORTED)
        _check_unsupported(self, _VLLM_CHAT_UNSUPPORTED)
        return self

    _whole_chat = field_validator("max_completion_tokens", "top_logprobs", mode="before")(classmethod(
        lambda cls, v: whole_number(v)))

    @model_validator(mode="after")
    def _tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise field_error("tools", f"function names must be unique, got {names}")
        choice = self.tool_choice
        if choice is None and not names:
            return self
        if choice == "none":
            return self
        if not names:
            raise field_error("tool_choice", "needs tools to call")
        if choice in (None, "auto"):
            # the server reads calls from the reply, if it has a parser (endpoints.py); with audio out, the
            # reply is voiced once its text is known to be no call (reply_stream.Run)
            return self
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise field_error("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools "
                              f"({', '.join(names)})")
        if "audio" in self.output_modalities:
            raise field_error("tool_choice", 'a tool call is not spoken: send modalities ["text"]')
        if self.response_format is not None and self.response_format.structured_outputs is not None \
                or self.structured_outputs is not None:
            raise field_error("tool_choice", "a forced tool call already constrains the reply (to the call's JSON): "
                              "send no response_format / structured_outputs with it")
        return self

    @property
    def auto_tools(self) -> bool:
        """tool_choice "auto" (the default with tools): a text reply or calls, as the model chooses."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def forced_tool(self) -> str | None:
        """What the reply must be: "required" (calls of any tools), a function's name, or None (text)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "needs logprobs: true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (not asked), else how many most likely tokens per position."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _audio_needs_audio_modality(self) -> "ChatCompletionRequest":
        if self.audio is not None and "audio" not in self.output_modalities:
            raise field_error("audio", 'set modalities to ["text", "audio"] to get audio')
        if self.stream and self.audio is not None and self.audio.format != "pcm16":
            raise field_error("audio.format", "streamed audio is pcm16 (set audio.format to pcm16)")
        return self

    @property
    def output_modalities(self) -> list[str]:
        return list(self.modalities or ["text"])

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class CompletionRequest(_Common):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], accepts(
        "a string, a list of token ids, or a batch of prompts (a list of strings or a list of token-id lists)"
    )] = Field(
        description="The prompt: text or token ids; or a batch of prompts (a list of strings, or a list of token-id "
        "lists), every one run at once: one choice per prompt and n, index prompt_index * n + i (vLLM's order).")
    logprobs: int | None = Field(None, ge=0, le=5, description="Return each token's log-probability and those "
                                 "of the 0..5 most likely tokens at its position (the text stage).")
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate at most (the text stage); 0 only "
                                   "with echo: the prompt alone comes back (with its logprobs), nothing generated.")
    best_of: Any = Field(None, description="Not implemented: null or 1.")
    echo: bool | None = Field(None, description="The text starts with the prompt as the text stage saw it, "
                              "decoded (token ids, or a chat template the stage wraps a raw prompt in); with "
                              "logprobs, the prompt's tokens come first in `logprobs` (the first with a null "
                              "logprob; the prompt is then recomputed: no prefix-cache hit). Streamed, the prompt "
                              "comes first, in a chunk of its own.")
    suffix: Any = Field(None, description='Not implemented: null or "".')
    add_special_tokens: bool | None = Field(None, description="vLLM's: a text prompt is tokenized with the "
                                            "tokenizer's special tokens (true, the default); false is not "
                                            "implemented.")

    _whole_completion = field_validator("logprobs", mode="before")(classmethod(lambda cls, v: whole_number(v)))

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        _check_unsupported(self, {**_COMPLETION_UNSUPPORTED, "add_special_tokens": (None, True)})
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "must be >= 1 (0 only with echo: true, which returns the prompt alone)")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_items(cls, prompt: Any) -> Any:
        """A list prompt checked item by item, so that a bad prompt of a batch is refused naming it (`prompt[2]`,
        `prompt[2][5]` for a token id); what no shape takes at all is then refused by the field's type (`prompt`).
        (A field validator, not the model's: a model `before` validator would have the whole request validated
        from Python objects, where strict mode refuses JSON's string keys of logit_bias.)"""
        if not isinstance(prompt, list):
            return prompt
        if not prompt:
            raise field_error("", "must not be empty")
        first = prompt[0]
        if _token_id(first):  # one prompt, as token ids
            bad = next((j for j, t in enumerate(prompt) if not _token_id(t)), None)
            if bad is not None:
                raise field_error(f"[{bad}]", "expected a token id (an integer), as prompt[0] is")
            return prompt
        if not isinstance(first, (str, list)):
            raise field_error("[0]", "expected a string, a list of token ids or a token id")
        kind = "a string" if isinstance(first, str) else "a list of token ids"
        for i, item in enumerate(prompt):
            if not isinstance(item, type(first)):
                raise field_error(f"[{i}]", f"expected {kind}, as prompt[0] is (a batch is of one kind)")
            if not item:
                raise field_error(f"[{i}]", "must not be empty")
            bad = next((j for j, t in enumerate(item) if not _token_id(t)), None) if isinstance(item, list) else None
            if bad is not None:
                raise field_error(f"[{i}][{bad}]", "expected a token id (an integer)")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: str | list[int] | list[str] | list[list[int]]) -> Any:
        if not v:
            raise ValueError("must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts in order: one, or the batch's."""
        p = self.prompt
        if isinstance(p, str) or _token_id(p[0]):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (not asked), else how many most likely tokens per position."""
        return self.logprobs
