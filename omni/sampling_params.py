"""Pure request data shared by the config and the engine (no torch, nothing of engine/ or pipeline/).

SamplingParams: how one request picks its next tokens (user-facing, validated); it takes every field of vLLM's
(those omni does not implement at their defaults only: omni/vllm_sampling.py).
`resolve_sampling_params` is the one place where a request's parameters are merged over a stage's
defaults (the API validates with it at submission, the engines when a request arrives).
`check_prefill_fits`: the batching arithmetic the config checks up front and the scheduler again
once max_model_len is resolved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from omni.errors import FIELD_ERROR, RequestError

from omni.config.strict import StrictFlag, no_bool_for_number
from omni.structured_spec import check_spec
from omni.vllm_sampling import VLLM_FIELDS, take_vllm_fields

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf and turns
# the softmax into NaNs, while the limit of temperature -> 0 is exactly argmax.
_GREEDY_EPS = 1e-5

# torch.Generator.manual_seed accepts exactly this range (negative seeds wrap modulo 2**64).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def check_prefill_fits(max_num_batched_tokens: int, max_model_len: int, enable_chunked_prefill: bool) -> None:
    """Without chunked prefill a whole prompt runs in one step: the step budget must hold the longest."""
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                         f"({max_model_len}) when enable_chunked_prefill is false")


def _check_min_le_max(min_tokens: int, max_tokens: int | None) -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")


class SamplingParams(BaseModel):
    """How to pick the next tokens of one request (vLLM / HF `generate` semantics).

    Takes every field of vLLM's SamplingParams: those below, and the ones omni does not implement at the values
    that ask for nothing (omni/vllm_sampling.py: any other value is refused by name, saying what to do)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    temperature: float = Field(
        1.0, description="Softmax temperature, >= 0. 0 means greedy decoding (argmax)."
    )
    top_k: int = Field(
        0, description="Keep only the k most likely tokens. 0 or -1 turns it off; otherwise >= 1."
    )
    top_p: float = Field(
        1.0,
        description="Nucleus sampling: keep the smallest set of most likely tokens whose cumulative "
        "probability is >= top_p (always at least one). 0 < top_p <= 1; 1 turns it off.",
    )
    seed: int | None = Field(
        None,
        description="Per-request random seed: the request draws from its own generator, so its tokens "
        "do not depend on the rest of the batch. None uses the global RNG.",
    )
    max_tokens: int = Field(16, description="Maximum number of tokens to generate, >= 1.")
    max_tokens_fit: StrictFlag = Field(
        False, description="max_tokens is a bound only: a prompt that leaves less room in max_model_len (less "
        "reserve_tokens) generates up to there instead of being refused (the Realtime API's max_output_tokens); "
        "a prompt that leaves no room at all is still refused.")
    reserve_tokens: int = Field(
        0, ge=0, description="With max_tokens_fit: tokens of max_model_len the reply leaves free (the sequence is "
        "a downstream stage's prompt, which needs room for that stage's own tokens).")
    min_tokens: int = Field(
        0,
        description="Generate at least this many tokens before the end-of-sequence token or a stop token "
        "may be sampled (vLLM's min_tokens: their logits are masked until then). 0 <= min_tokens <= max_tokens.",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Extra token ids (>= 0) that end generation; the stop token is kept in the token ids and, as "
        "in vLLM, left out of the text (as the eos token is) unless include_stop_str_in_output.",
    )
    ignore_eos: StrictFlag = Field(
        False, description="Keep generating past the end-of-sequence token (benchmarks)."
    )
    stop: list[str] = Field(
        default_factory=list,
        description="vLLM's stop strings (a str or a list): generation ends as soon as the reply's text holds one "
        "(the earliest wins); the text ends before it (with include_stop_str_in_output, after it), the token ids keep "
        "the token that completed it, finish_reason 'stop' and stop_reason the string. Needs the stage's tokenizer.",
    )
    include_stop_str_in_output: StrictFlag = Field(
        False, description="The reply's text keeps the stop string that ended it (vLLM's option).")
    skip_special_tokens: StrictFlag = Field(
        True, description="The reply's text leaves out special tokens (vLLM's default); false keeps them "
        "(<|im_end|> and the like). Token ids are the same either way.")
    spaces_between_special_tokens: StrictFlag = Field(
        True, description="vLLM's: with skip_special_tokens false, whether special tokens are set apart by spaces in "
        "the text. Accepted for vLLM's clients; as with vLLM's fast detokenizer, which every tokenizer omni loads is "
        "(transformers 5), the tokenizer's own decoding decides and this changes nothing.")
    truncate_prompt_tokens: int | None = Field(
        None, description="vLLM's: keep only the last k tokens of the prompt (left truncation), k >= 1, or -1 for "
        "the stage's max_model_len; at most max_model_len. Applies where the prompt is the caller's (the "
        "pipeline's entry stage); a stage that renders its own prompt (multimodal positions, e.g. Qwen-Omni's "
        "thinker) refuses a prompt that would have to be cut. None: never cut (a prompt longer than "
        "max_model_len is refused).")
    repetition_penalty: float = Field(
        1.0,
        description="HF repetition penalty, > 0: for tokens seen in prompt + output, positive logits are "
        "divided by it and negative ones multiplied. 1 turns it off.",
    )
    presence_penalty: float = Field(
        0.0,
        description="OpenAI / vLLM presence penalty, -2..2: subtracted from the logit of every token the output "
        "so far holds (the prompt does not count). 0 turns it off.",
    )
    frequency_penalty: float = Field(
        0.0,
        description="OpenAI / vLLM frequency penalty, -2..2: subtracted from a token's logit once per time the "
        "output so far holds it (the prompt does not count). 0 turns it off.",
    )
    logit_bias: dict[int, float] | None = Field(
        None,
        description="OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before the "
        "penalties and sampling (-100 in effect bans the token, 100 forces it). Ids must be in the stage's "
        "vocabulary.",
    )
    logprobs: int | None = Field(
        None,
        description="Return each generated token's log-probability and those of the `logprobs` most likely "
        "tokens at its step (0: the generated token's only), 0..20, from the model's raw logits (before "
        "penalties, bias and temperature, as vLLM). None: no log-probabilities.",
    )
    prompt_logprobs: int | None = Field(
        None,
        description="vLLM's prompt_logprobs, 0..20: each prompt token's log-probability given the tokens before it "
        "(the first has none) and the `prompt_logprobs` most likely tokens at its position, from the raw logits. "
        "The request then recomputes its whole prompt (a prefix-cache hit has no logits to give).",
    )
    echo_prompt: StrictFlag = Field(
        False,
        description="The finished output also carries the prompt decoded by the stage's tokenizer (`prompt_text`) "
        "and, with prompt_logprobs, each prompt token decoded alone (`prompt_token_texts`): what the completions "
        "endpoint's `echo` sends back (the prompt may have been given as token ids).",
    )
    min_p: float = Field(
        0.0,
        description="HF / vLLM min-p sampling, 0..1: after temperature, top-k and top-p, drop the tokens whose "
        "probability is below min_p times the most likely token's (which always stays). 0 turns it off.",
    )

    forced_token_ids: list[int] | None = Field(
        None,
        description="The reply is exactly these token ids: the stage prefills the prompt and them in one "
        "pass (their KV blocks and per-token rows are computed as if it had generated them), samples nothing "
        "and finishes with finish_reason 'stop'. max_tokens, stop tokens and eos do not apply. A text-to-speech "
        "request forces the thinker's reply this way so that the talker voices exactly the input.",
    )
    forced_text: str | None = Field(
        None,
        description="forced_token_ids given as text: the stage tokenizes it (no special tokens added) and "
        "appends its end-of-sequence token, as a reply the model wrote itself ends. Not with forced_token_ids.",
    )

    detokenize: StrictFlag = Field(
        True, description="vLLM's: false leaves the reply's text empty (StageOutput.text and the deltas' text are "
        "\"\", the token ids are the reply): a stage whose tokens are not text (a talker's codec codes) skips "
        "decoding them. Log-probabilities and echo's prompt text, when asked for, still carry their texts. Not "
        "with stop strings (they are looked for in the text).")
    skip_reading_prefix_cache: StrictFlag = Field(
        False, description="vLLM's: true computes the whole prompt, reading nothing from the prefix cache (what it "
        "computes is still cached for others). False (or null): cached blocks are used, except with prompt_logprobs, "
        "which always computes the whole prompt.")
    extra_args: dict[str, Any] | None = Field(
        None, description="vLLM's: arbitrary arguments for custom sampling code; carried to the stage's model with "
        "the request's parameters. No stage of omni's reads any (vLLM's own sampling reads none either).")

    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="Constrain the reply (vLLM's structured outputs, compiled by llguidance against the stage's "
        "tokenizer): exactly one of {'json': a JSON schema (or its JSON text)}, {'json_object': true}, {'regex': "
        "str}, {'choice': [str, ...]}. The request finishes ('stop') once the grammar is complete. Not with a forced "
        "reply nor min_tokens.",
    )

    _no_bool_for_number = field_validator("*", mode="before")(classmethod(no_bool_for_number))

    @model_validator(mode="before")
    @classmethod
    def _vllm_fields(cls, data: Any) -> Any:
        return take_vllm_fields(data)

    @model_validator(mode="after")
    def _stop_needs_text(self) -> SamplingParams:
        if self.stop and not self.detokenize:
            raise PydanticCustomError(FIELD_ERROR, "{field}: {text}", {
                "field": "stop", "text": "stop strings are looked for in the reply's text: not with detokenize false "
                "(as vLLM); send stop_token_ids, or detokenize true"})
        return self

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len) or an integer >= 1, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or an integer >= 1, got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v: float) -> float:
        if not (0.0 < v <= 1.0):  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v: int | None) -> int | None:
        if v is not None and not (_SEED_MIN <= v <= _SEED_MAX):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {v}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {v}")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _check_min_tokens(cls, v: int, info: ValidationInfo) -> int:
        if v < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {v}")
        _check_min_le_max(v, info.data.get("max_tokens"))  # max_tokens is validated first (field order)
        return v

    @model_validator(mode="after")
    def _check_min_le_max_on_assignment(self) -> SamplingParams:
        # Assigning max_tokens alone re-runs only this validator: the error still names the field.
        try:
            _check_min_le_max(self.min_tokens, self.max_tokens)
        except ValueError as e:
            raise PydanticCustomError(FIELD_ERROR, "{field}: {text}", {"field": "min_tokens", "text": str(e)}) from None
        return self

    @field_validator("structured_outputs")
    @classmethod
    def _check_structured_outputs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        return check_spec(v)

    @model_validator(mode="after")
    def _check_structured_combinations(self) -> SamplingParams:
        if self.structured_outputs is not None:
            clash = ("forced_token_ids" if self.forced_token_ids is not None else "forced_text"
                     if self.forced_text is not None else "min_tokens" if self.min_tokens else None)
            if clash is not None:
                raise PydanticCustomError(FIELD_ERROR, "{field}: {text}", {
                    "field": "structured_outputs",
                    "text": f"cannot be combined with {clash} (the grammar decides where the reply ends)"})
        return self

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: list[int]) -> list[int]:
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {bad}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else [] if v is None else v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return list(dict.fromkeys(v))

    @field_validator("forced_token_ids")
    @classmethod
    def _check_forced_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(t < 0 for t in v)):
            raise ValueError(f"forced_token_ids must be a non-empty list of token ids >= 0, got {v[:8]}")
        return v

    @field_validator("forced_text")
    @classmethod
    def _check_forced_text(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and not v:
            raise ValueError("forced_text must not be empty")
        if v is not None and info.data.get("forced_token_ids") is not None:
            raise ValueError("forced_text and forced_token_ids are two ways to say one thing: send one of them")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _check_repetition_penalty(cls, v: float) -> float:
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, v: float, info: ValidationInfo) -> float:
        if not (-2.0 <= v <= 2.0):  # also rejects NaN
            raise ValueError(f"{info.field_name} must be in [-2, 2] (0 = off), got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return v
        bad = {t: b for t, b in v.items() if t < 0 or not (-100.0 <= b <= 100.0)}  # NaN fails the range
        if bad:
            raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {bad}")
        return v or None  # {} asks for nothing

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _check_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not (0 <= v <= 20):
            raise ValueError(f"{info.field_name} must be None or 0..20 (the most likely tokens to return), got {v}")
        return v

    @field_validator("min_p")
    @classmethod
    def _check_min_p(cls, v: float) -> float:
        if not (0.0 <= v <= 1.0):  # also rejects NaN
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {v}")
        return v

    @property
    def uses_output_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0


def is_sampling_field(name: str) -> bool:
    """A name SamplingParams takes: one of its fields, or a vLLM field it knows (omni/vllm_sampling.py)."""
    return name in SamplingParams.model_fields or name in VLLM_FIELDS


def resolve_sampling_params(value: Any, defaults: SamplingParams, stage: str | None = None) -> SamplingParams:
    """A request's parameters: None -> the stage defaults; a SamplingParams as is; a mapping of fields
    merged over the defaults. Raises RequestError naming the field (of `stage`): bad fields are the
    caller's to fix wherever they are found, at the edge or in a stage's engine."""
    where = "sampling_params" if stage is None else f"sampling_params for stage {stage!r}"
    if value is None:
        return defaults
    if isinstance(value, SamplingParams):
        return value
    if not isinstance(value, Mapping):
        raise RequestError(f"{where}: expected a SamplingParams or a dict, got {type(value).__name__}",
                           stage=stage, field="sampling_params")
    try:
        return SamplingParams(**{**defaults.model_dump(), **value})
    except ValidationError as e:
        errors = e.errors()
        # (a model validator's error has no loc: its message starts with the field)
        msgs = "; ".join(f"{'.'.join(map(str, x['loc']))}: " * bool(x["loc"])
                         + x["msg"].removeprefix("Value error, ") for x in errors)
        # The first field at fault (a model validator has no loc: its message names the field).
        first = errors[0]
        name = ".".join(map(str, first["loc"])) or first.get("ctx", {}).get("field", "")
        code = ("unknown_parameter" if first["type"] == "extra_forbidden"
                else first.get("ctx", {}).get("code", "invalid_value"))
        raise RequestError(f"{where}: {msgs}", stage=stage, field=f"sampling_params.{name}", code=code) from None
