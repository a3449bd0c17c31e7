"""Chat completions' request (OpenAI's openai/types/chat/completion_create_params.py, every field known; the
fields it shares with completions in protocol/generation.py): messages with text, image and audio parts, tools,
audio output.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from omni.config.pydantic_errors import accepts
from omni.serve.protocol.base import RequestModel, check_unsupported, check_voice, field_error, voice_name, whole_number
from omni.serve.protocol.generation import GenerationRequest

# OpenAI fields this server does not implement -> the values that ask for nothing (null first, then the
# default). Anything else is refused naming the field.
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
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
VLLM_CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "add_special_tokens": (None, False),
    "chat_template": (None,),
    "documents": (None,),
    "media_io_kwargs": (None, {}),
}



# ------------------------------------------------------------------- content
class TextPart(RequestModel):
    type: Literal["text"] = Field(description="A text part.")
    text: str = Field(description="The text.")


class ImageURL(RequestModel):
    url: str = Field(description="A data: URL, data:image/png;base64,... (PNG, JPEG, WEBP, GIF, BMP).")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="Accepted; the model's own "
                                                           "resolution rules apply.")


class ImagePart(RequestModel):
    type: Literal["image_url"] = Field(description="An image part.")
    image_url: ImageURL = Field(description="The image.")


class InputAudio(RequestModel):
    data: str = Field(description="The audio file, base64.")
    format: Literal["wav", "mp3", "flac", "ogg"] = Field(description="Its container format.")


class InputAudioPart(RequestModel):
    type: Literal["input_audio"] = Field(description="An audio part (OpenAI's shape).")
    input_audio: InputAudio = Field(description="The audio.")


class AudioURL(RequestModel):
    url: str = Field(description="A data: URL, data:audio/wav;base64,...")


class AudioURLPart(RequestModel):
    type: Literal["audio_url"] = Field(description="An audio part (vLLM's shape).")
    audio_url: AudioURL = Field(description="The audio.")


class VideoURL(RequestModel):
    url: str = Field(description="A data: URL, data:video/mp4;base64,... (mp4, webm, mkv, mov, ...).")


class VideoURLPart(RequestModel):
    type: Literal["video_url"] = Field(description="A video part (vLLM's shape); with mm_processor_kwargs."
                                       "use_audio_in_video, its audio track is heard too.")
    video_url: VideoURL = Field(description="The video.")


ContentPart = Annotated[TextPart | ImagePart | InputAudioPart | AudioURLPart | VideoURLPart,
                        Field(discriminator="type")]
PART_TAGS = frozenset({"text", "image_url", "input_audio", "audio_url", "video_url"})  # dropped from error paths


class AssistantAudio(RequestModel):
    """An earlier spoken reply: by id (OpenAI's pattern; the server puts its transcript back, state.py), or
    the reply's own `message.audio` sent back whole (its transcript is used; the audio data is not read)."""

    id: str = Field(description="The id of an earlier reply's audio.")
    data: str | None = Field(None, description="Accepted (the reply's audio, sent back); not read.")
    expires_at: int | None = Field(None, description="Accepted; not read.")
    transcript: str | None = Field(None, description="The reply's text: the assistant turn's content when the "
                                   "message has none.")


class FunctionCall(RequestModel):
    name: str = Field(min_length=1, description="The function called.")
    arguments: str = Field(description="Its arguments: a JSON object, as text.")


class ToolCall(RequestModel):
    id: str = Field(min_length=1, description="The call's id (a tool message answers it by tool_call_id).")
    type: Literal["function"] = Field(description="function.")
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Who speaks.")
    content: list[ContentPart] | None = Field(
        None, description="Text, or a list of text / image_url / input_audio / audio_url / video_url parts.")
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
class FunctionDef(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="The function's name.")
    description: str | None = Field(None, description="What it does (the chat template shows it to the model).")
    parameters: dict[str, Any] | None = Field(None, description="Its arguments: a JSON schema of an object.")
    strict: bool | None = Field(None, description="Accepted: forced calls always follow the schema here.")


class ToolDef(RequestModel):
    type: Literal["function"] = Field(description="function.")
    function: FunctionDef


class FunctionName(RequestModel):
    name: str = Field(min_length=1)


class NamedToolChoice(RequestModel):
    type: Literal["function"] = Field(description="function.")
    function: FunctionName


class AudioOutput(RequestModel):
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
        "little-endian mono at the pipeline's rate; required when streaming, unless omni_stream_format is "
        "vllm-omni).")



class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens.")
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, min_length=1, description='What to reply with: ["text"] or ["text", "audio"]; absent: the server\'s '
        "--default-modalities (text, as OpenAI's).")
    speaker: str | None = Field(None, min_length=1, description="vLLM-Omni's: an alias of audio.voice.")
    audio: AudioOutput | None = Field(None, description="Audio reply options (with modalities audio).")
    # OpenAI's fields this server does not implement (see CHAT_UNSUPPORTED for what each accepts) and
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
        "openai", description="Streaming audio: openai sends it as pcm16 in delta.audio.data; vllm-omni (what "
        "vLLM-Omni sends) gives each chunk a top-level modality ('text' or 'audio') and each audio chunk's base64 "
        "in delta.content, as a file of its own in audio.format (wav by default; pcm16: raw samples).")

    @model_validator(mode="after")
    def _server_default_modalities(self, info: ValidationInfo) -> "ChatCompletionRequest":
        """No `modalities`: the server's default (parse_request's context), text when none is given. (First of the
        after-validators: those below read output_modalities.)"""
        default = (info.context or {}).get("default_modalities")
        if self.modalities is None and default:
            self.modalities = list(default)
        return self

    @model_validator(mode="after")
    def _speaker_is_audio_voice(self) -> "ChatCompletionRequest":
        voice = self.audio.speaker if self.audio is not None else None
        if self.speaker is not None and voice is not None and voice != self.speaker:
            raise field_error("speaker", f"an alias of audio.voice, which names another voice ({voice!r}); send one")
        return self

    @property
    def voice(self) -> tuple[str | None, str]:
        """The reply's voice and the field that named it (audio.voice, or vLLM-Omni's speaker)."""
        if self.audio is not None and self.audio.speaker:
            return self.audio.speaker, self.audio.voice_field
        return self.speaker, "speaker"

    @model_validator(mode="after")
    def _unsupported(self) -> "ChatCompletionRequest":
        check_unsupported(self, CHAT_UNSUPPORTED)
        check_unsupported(self, VLLM_CHAT_UNSUPPORTED)
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
            # the server reads calls from the reply, if it has a parser (chat/serving_chat.py); with audio out, the
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
        if (self.stream and self.audio is not None and self.audio.format != "pcm16"
                and self.omni_stream_format == "openai"):  # vLLM-Omni's streams a file of audio.format per chunk
            raise field_error("audio.format", "streamed audio is pcm16 (set audio.format to pcm16, or "
                              "omni_stream_format to vllm-omni for each chunk as a file of audio.format)")
        return self

    @property
    def output_modalities(self) -> list[str]:
        return list(self.modalities or ["text"])

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

