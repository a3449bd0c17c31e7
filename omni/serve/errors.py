"""OpenAI-shaped errors, and the one place that turns omni's errors into them.

Every error the server answers is `{"error": {"message", "type", "param", "code"}}` with `param`
naming the request field at fault (`messages[0].content[1].image_url.url`, `temperature`,
`sampling_params_list[1].max_tokens`). Omni reports a bad request as a ValueError naming its own
field (`prompts[0]: prompt: ...`, `sampling_params for stage 'talker': max_tokens: ...`) or, once it
reached a stage, as the request's error (`stage 'thinker' failed: invalid request: ValueError:
prompt: ...`); `from_omni_error` maps both back onto the request's fields. What is not the user's
fault (a stage crashed, a forward pass failed) is a 500 that says so, never a traceback.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

INVALID = "invalid_request_error"

# "stage 'thinker' failed: invalid request: ValueError: prompt: 300 tokens ..." (stage_worker admission)
_ADMISSION_RE = re.compile(r"^stage '(?P<stage>[^']+)' failed: invalid request: \w+: (?P<rest>.*)$", re.S)
# "prompts[0]: prompt: messages[1].content: ..." (omni.prompts at the edge)
_EDGE_RE = re.compile(r"^prompts\[\d+\]: (?P<rest>.*)$", re.S)
# "sampling_params for stage 'talker': max_tokens: ..." (Omni._stage_params)
_SAMPLING_RE = re.compile(r"^sampling_params for stage '(?P<stage>[^']+)': (?P<field>[\w.]+): ", re.S)
# "prompt: 20 tokens + max_tokens 500 = 520 exceed max_model_len 256 of stage 'thinker'" (engine admission)
_TOO_LONG_RE = re.compile(r"(?P<prompt>\d+) tokens \+ max_tokens \d+ = \d+ exceed max_model_len (?P<limit>\d+)")
_FIELD_RE = re.compile(r"^(?P<field>[A-Za-z_][\w.]*(\[\d+\])*(\.[A-Za-z_]\w*(\[\d+\])*)*)\s*:")


class ApiError(Exception):
    """An HTTP error with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def too_large(message: str, param: str | None = None) -> ApiError:
    return ApiError(413, message, param=param, code="request_too_large")


def internal(message: str) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")


# ------------------------------------------------------------------ pydantic
def loc_to_param(loc: tuple[Any, ...], tags: frozenset[str] = frozenset()) -> str:
    """('messages', 0, 'content', 1, 'image_url', 'url') -> 'messages[0].content[1].image_url.url'.

    `tags`: discriminator values pydantic puts into the path of a tagged union (dropped after an index)."""
    out = ""
    after_index = False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            after_index = True
            continue
        if after_index and part in tags:
            after_index = False
            continue
        after_index = False
        if "[" in part or part.startswith("function-"):  # union member names, validator wrappers
            continue
        out += f".{part}" if out else part
    return out


def from_validation_error(err: ValidationError, tags: frozenset[str] = frozenset()) -> ApiError:
    """The first problem pydantic found, naming its field."""
    errors = err.errors()
    e = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])  # an unknown field first
    param = loc_to_param(tuple(e["loc"]), tags) or None
    if e["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if e["type"] == "missing":
        return bad_request(f"{param}: required field is missing", param, "missing_required_parameter")
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "value_error" and (field := _field_of(msg)):  # a model validator naming its field
        param = f"{param}.{field}" if param else field
        msg = msg[len(field) + 1:].lstrip()
    shown = repr(e.get("input"))
    got = f" (got {shown[:60]})" if not isinstance(e.get("input"), (dict, list)) else ""
    return bad_request(f"{param}: {msg}{got}" if param else msg, param, "invalid_value")


# ---------------------------------------------------------------- omni's own
def _field_of(text: str) -> str | None:
    m = _FIELD_RE.match(text)
    return m.group("field") if m else None


def from_omni_error(message: str, fields: Mapping[str, str], sampling_param: Any = None) -> ApiError:
    """An omni error (a ValueError's text at submission, or a failed request's error) as an ApiError.

    `fields`: omni's names -> the request's (`prompt` -> `messages`, `multi_modal_data.image[0]` ->
    `messages[0].content[1].image_url`, `speaker` -> `audio.voice`); `sampling_param(stage, field)`:
    the request field that set a stage's sampling field."""
    if "timed out after" in message and "request_timeout_s" in message:
        return ApiError(504, message, type="timeout_error", code="request_timeout")
    if m := _SAMPLING_RE.match(message):
        param = sampling_param(m.group("stage"), m.group("field")) if sampling_param else m.group("field")
        return bad_request(message, param, "invalid_value")
    rest = None
    if m := _EDGE_RE.match(message):
        rest = m.group("rest")
    elif m := _ADMISSION_RE.match(message):
        rest = m.group("rest")
    if rest is None:
        return internal(f"the pipeline failed this request: {message}")
    field = _field_of(rest)
    param = None
    if field is not None:
        head = field.split(".")[0].split("[")[0]
        if head == "prompt":  # "prompt: messages[1].content: ..." names a message; else the whole prompt
            sub = _field_of(rest.removeprefix("prompt: "))
            param = sub if sub is not None and sub.startswith("messages[") else fields.get("prompt")
        elif field.startswith("multi_modal_data"):  # one item, or all of them: the first then
            base = re.match(r"multi_modal_data\.\w+\[\d+\]", field)
            media = [v for k, v in fields.items() if k.startswith("multi_modal_data.")]
            param = fields.get(base.group(0)) if base else (media[0] if media else None)
            param = param or fields.get("prompt")
        else:
            param = fields.get(field) or fields.get(head) or fields.get("prompt")
    code = "invalid_value"
    if m := _TOO_LONG_RE.search(rest):
        code = "context_length_exceeded"
        if int(m.group("prompt")) < int(m.group("limit")):  # the prompt fits: max_tokens is what is too large
            param = fields.get("max_tokens", param)
    return bad_request(message, param, code)
