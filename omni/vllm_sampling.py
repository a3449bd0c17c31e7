"""vLLM's SamplingParams fields that omni's SamplingParams has no field for, known by name.

Clients written for vLLM / vLLM-Omni send vLLM's fields, often at their defaults (every vLLM-Omni example sends
`detokenize`; a serialised vLLM SamplingParams carries `n`, `output_kind`, `skip_clone`, ...). The fields omni
implements are SamplingParams' own (omni/sampling_params.py: `detokenize`, `extra_args` and
`skip_reading_prefix_cache` among them). The others (vllm/sampling_params.py, main and the earlier fields
vLLM-Omni's pinned vLLM versions still have) are known here: `take_vllm_fields` drops one whose value asks for
nothing (its default, or a value that means the same) and refuses any other value by name, with what to do
instead (code `unsupported_parameter`): an "extra inputs" error would leave a vLLM user guessing, and a dropped
non-default value would silently sample something else.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

from pydantic_core import PydanticCustomError

from omni.config.pydantic_errors import shown
from omni.errors import FIELD_ERROR

_NO_BEAM = "there is no beam search here: sample (temperature, top_p, top_k) or decode greedily (temperature 0)"
_TOKEN_LOGPROBS = "use logprobs / prompt_logprobs (the k most likely tokens at each position, 0..20)"

# name -> (the values that ask for nothing, what to do instead of another value)
VLLM_FIELDS: dict[str, tuple[tuple[Any, ...], str | None]] = {
    "n": ((1,), "one request is one sample here: submit the prompt n times (with seed + i for n different seeded "
                "samples), as the server's n does"),
    "best_of": ((None, 1), "one request is one sample here: submit the prompt several times and keep the best"),
    "use_beam_search": ((False,), _NO_BEAM),
    "length_penalty": ((1.0,), _NO_BEAM),
    "early_stopping": ((False,), _NO_BEAM),
    "guided_decoding": ((None,), "use structured_outputs ({'json': schema} | {'regex': ...} | {'choice': [...]})"),
    "logits_processors": ((None, []), "use logit_bias, the penalties or structured_outputs"),
    "allowed_token_ids": ((None,), "use structured_outputs ({'choice': [...]}) or logit_bias"),
    "bad_words": ((None, []), "use logit_bias with -100 for their token ids"),
    "logprob_token_ids": ((None,), _TOKEN_LOGPROBS),
    "prompt_logprob_token_ids": ((None,), _TOKEN_LOGPROBS),
    "prompt_logprob_start": ((None, 0), _TOKEN_LOGPROBS + "; the prompt's are given from its first token"),
    "flat_logprobs": ((False,), "log-probabilities come back as omni's TokenLogprob lists (StageOutput.logprobs)"),
    "output_kind": ((0,), "how outputs arrive is the API's choice here: Omni.generate / AsyncOmni.generate return "
                          "finished outputs, stream() yields each stage's deltas as they are computed"),
    "stream_interval": ((None, 1), "a streamed request's tokens come as each step samples them"),
    "output_text_buffer_length": ((0,), "vLLM's internal field; stop strings hold back what they need here"),
    "thinking_token_budget": ((None, -1), "omni does not count thinking tokens: bound the reply with max_tokens"),
    "repetition_detection": ((None,), "use repetition_penalty, presence_penalty or frequency_penalty"),
    "routed_experts_prompt_start": ((0,), "omni does not return routed experts"),
    "trace_decode_token_ids": ((None,), "forced_token_ids makes the reply exactly given tokens (not sampled, "
                                        "without logprobs)"),
    # a permission (no deep copy): nothing to honour or to refuse either way
    "skip_clone": ((False, True), None),
}


# vLLM's null for a field whose default omni spells otherwise
_NULL_IS_DEFAULT: dict[str, Any] = {"stop_token_ids": list, "skip_reading_prefix_cache": bool}


def _same(value: Any, accepted: Any) -> bool:
    """JSON equality without Python's bool/int mixing (`false` is not 0) and with 0 == 0.0."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    return value == accepted and type(value) in (type(accepted), int, float)


def _plain(name: str, value: Any) -> Any:
    """vLLM's enum (RequestOutputKind.CUMULATIVE, or its name as text) as the number msgspec sends it."""
    if name == "output_kind":
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, str):
            return {"cumulative": 0, "delta": 1, "final_only": 2}.get(value.lower(), value)
    return value


def _refused(name: str, value: Any) -> PydanticCustomError:
    accepted, advice = VLLM_FIELDS[name]
    nothing = " or ".join("null" if a is None else json.dumps(a) for a in accepted)
    if name == "output_kind":
        nothing += " (RequestOutputKind.CUMULATIVE)"
    if advice is None:  # any value of its type is taken
        return PydanticCustomError(FIELD_ERROR, "{field}: {text}", {
            "field": name, "text": f"expected {nothing} (got {shown(value)})"})
    return PydanticCustomError(FIELD_ERROR, "{field}: {text}", {
        "field": name, "code": "unsupported_parameter",
        "text": f"vLLM's {name} is not supported: {advice} (send it absent or as {nothing}; got {shown(value)})"})


def take_vllm_fields(data: Any) -> Any:
    """SamplingParams' input without the vLLM fields it has no field for (each at a value that asks for nothing)
    and with vLLM's nulls for its defaults; raises a field error (code unsupported_parameter) naming the first
    vLLM field at any other value."""
    if not isinstance(data, Mapping):
        return data
    if "max_tokens" in data and data["max_tokens"] is None:
        raise PydanticCustomError(FIELD_ERROR, "{field}: {text}", {
            "field": "max_tokens", "code": "unsupported_parameter", "text": "vLLM's null (up to max_model_len) is "
            "not supported: every reply has a bound here; send a number (with max_tokens_fit: true it is lowered to "
            "what the prompt leaves in max_model_len)"})
    kept = {}
    for name, value in data.items():
        if name in VLLM_FIELDS:
            if not any(_same(_plain(name, value), a) for a in VLLM_FIELDS[name][0]):
                raise _refused(name, value)
        else:
            kept[name] = _NULL_IS_DEFAULT[name]() if value is None and name in _NULL_IS_DEFAULT else value
    return kept

