"""The fields chat completions and completions share (the OpenAI request shapes, pydantic at the edge).

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
ignored. vLLM's own request fields are known the same way (VLLM_UNSUPPORTED: what clients written for vLLM
send, often at their defaults), or taken (truncate_prompt_tokens, chat_template_kwargs, guided_json, request_id,
stream_options.continuous_usage_stats, ...). A field neither has is a 400 (`unknown_parameter`), as OpenAI's.
Integer fields take whole-number floats (5.0), as vLLM's lax pydantic does; strings and booleans stay refused.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from omni.config.pydantic_errors import accepts
from omni.serve.protocol.base import RequestModel, check_unsupported, field_error, whole_number

# vLLM's own request fields (vllm/entrypoints/openai/protocol.py) that clients written for vLLM send, often at
# their defaults: known here, so that they are accepted at those values and refused by name otherwise, as OpenAI's
# (guided_json / guided_regex / guided_choice, vLLM's older spelling of structured outputs, are taken: chat/jobs.py)
VLLM_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
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
    "prompt_embeds": (None,),
}

# ------------------------------------------------------------------ requests
class StreamOptions(RequestModel):
    include_usage: bool = Field(False, description="Send one more chunk with the usage before [DONE].")
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk also carries "
                                         "the usage so far.")



class JsonSchemaFormat(RequestModel):
    name: str = Field(min_length=1, max_length=64, description="The schema's name (OpenAI requires one).")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the reply follows.")
    description: str | None = Field(None, description="Accepted; not used.")
    strict: bool | None = Field(None, description="Accepted: the reply always follows the schema (a grammar "
                                "constrains every token).")


class ResponseFormat(RequestModel):
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


class GenerationRequest(RequestModel):
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
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: how the model's processor takes the media. {\"use_audio_in_video\": true}: each "
        "video's audio track interleaved with its frames by time (the Qwen omni thinkers).")
    prompt_embeds: Any = Field(None, description="vLLM's: not implemented over HTTP (null); the Python API takes "
                               "prompt_embeds.")
    sampling_params_list: list[dict[str, Any] | None] | None = Field(
        None, description="One entry per stage in config order (vLLM-Omni): SamplingParams fields (any of vLLM's: "
        "one omni does not implement only at its default) merged over that stage's defaults, or null. The "
        "top-level fields above then apply to the text stage.")
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
    def _vllm_unsupported(self) -> "GenerationRequest":
        check_unsupported(self, VLLM_UNSUPPORTED)
        for key, value in (self.mm_processor_kwargs or {}).items():
            if key != "use_audio_in_video":
                raise field_error(f"mm_processor_kwargs.{key}", "not a setting this server's processors take "
                                  "(use_audio_in_video)", "unsupported_parameter")
            if not isinstance(value, bool):
                raise field_error("mm_processor_kwargs.use_audio_in_video", f"expected true or false, got {value!r}")
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
    def _stream_options_need_stream(self) -> "GenerationRequest":
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

