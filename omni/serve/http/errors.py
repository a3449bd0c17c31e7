"""OpenAI-shaped errors, and the one place that turns omni's errors into them.

Every error the server answers is `{"error": {"message", "type", "param", "code"}}` with `param`
naming the request field at fault (`messages[0].content[1].image_url.url`, `temperature`,
`sampling_params_list[1].max_tokens`). Omni's errors are typed (omni/errors.py): their class picks the
HTTP status through `_STATUS`, their `code` is the body's code, and their `field` (omni's path inside
one prompt: `prompt.messages[1].content`, `multi_modal_data.image[0]`, `sampling_params.max_tokens`
with its stage) becomes the request's field through the Job's table. Pydantic's names for a union's members
(`str`, `list[str]`, `NamedToolChoice`) never reach `param`: a value no member takes is refused naming the
field and what it takes (`stop: expected a string or a list of up to 16 strings`). No message is ever parsed:
messages stay human. What is not the user's fault (a stage crashed, a forward pass failed) is a 500
that says so, never a traceback.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from omni.errors import (FIELD_ERROR, BackendClosedError, OmniError, RequestAbortedError, RequestError, RequestTimeoutError,
                         StageError)
from omni.config.pydantic_errors import UNION_ERROR, Problem, got, resolve, shown, union_message, wrong_type

INVALID = "invalid_request_error"
SERVER = "server_error"

# An omni error's class (the most specific one in its MRO) -> HTTP status and OpenAI error type.
_STATUS: dict[type[OmniError], tuple[int, str]] = {
    RequestError: (400, INVALID),
    RequestTimeoutError: (504, "timeout_error"),
    RequestAbortedError: (500, SERVER),
    BackendClosedError: (503, SERVER),
    StageError: (500, SERVER),
    OmniError: (500, SERVER),
}
# Codes whose status is not their class's: a request aborted because the pipeline closes.
_CODE_STATUS: dict[str, tuple[int, str]] = {"shutting_down": (503, SERVER)}


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


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def too_large(message: str, param: str | None = None) -> ApiError:
    return ApiError(413, message, param=param, code="request_too_large")


def internal(message: str) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")


# ------------------------------------------------------------------ pydantic
# Union resolution and field paths are omni/config/pydantic_errors.py's (the config loader renders from them too);
# here they become OpenAI error bodies.
def from_validation_error(err: ValidationError, tags: frozenset[str] = frozenset()) -> ApiError:
    """The first problem pydantic found, naming its field (as the user wrote it: no union member's name)."""
    e, members, union = resolve(err.errors())
    problem = Problem(e, members, union)
    param = problem.path(tags) or None
    if union is not None:  # no member of a union took the value: say what the field takes
        msg = union_message(union)
        return bad_request(f"{param}: {msg}" if param else msg, param, "invalid_value")
    if e["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if e["type"] == "missing":
        return bad_request(f"{param}: required field is missing", param, "missing_required_parameter")
    if e["type"] == UNION_ERROR:
        msg = f"{e['msg']}{got(e.get('input'))}"
        return bad_request(f"{param}: {msg}" if param else msg, param, "invalid_value")
    if wrong_type(e):
        expected = e.get("ctx", {}).get("expected", "").replace("'", '"')
        msg = f"type {shown(e.get('input'))} is not supported (only {expected})"
        return bad_request(f"{param}: {msg}" if param else msg, param, "invalid_value")
    msg = e["msg"].removeprefix("Value error, ")
    code = "invalid_value"
    if e["type"] == FIELD_ERROR:  # a model validator naming its field (as data: protocol.field_error)
        field = e["ctx"]["field"]
        # (a field's own validator names a part of it: `[2]` under `prompt` is `prompt[2]`)
        param = (f"{param}{field}" if not field or field.startswith("[") else f"{param}.{field}") if param else field
        msg = e["ctx"]["text"]
        code = e["ctx"].get("code", code)
    value_got = f" (got {shown(e.get('input'))})" if not isinstance(e.get("input"), (dict, list)) else ""
    return bad_request(f"{param}: {msg}{value_got}" if param else msg, param, code)


# ---------------------------------------------------------------- omni's own
def request_param(field: str | None, stage: str | None, fields: Mapping[str, str],
                  sampling_param: Callable[[str, str], str] | None = None) -> str | None:
    """Omni's field path -> the request's field. `fields`: omni's names -> the request's (`prompt` ->
    `messages`, `multi_modal_data.image[0]` -> `messages[0].content[1].image_url`, `speaker` ->
    `audio.voice`); `sampling_param(stage, name)`: the request field that set a stage's sampling field."""
    if field is None:
        return None
    if field.startswith("sampling_params."):
        name = field.removeprefix("sampling_params.")
        if sampling_param is not None and stage is not None:
            return sampling_param(stage, name)
        return fields.get(name, name)
    if field.startswith("prompt.messages[") and fields.get("prompt") == "messages":
        return field.removeprefix("prompt.")  # chat messages are the request's own
    for key in sorted(fields, key=len, reverse=True):  # the field itself, or what it is part of
        if field == key or field.startswith((key + ".", key + "[")):
            return fields[key]
    under = [v for k, v in fields.items() if k.startswith((field + ".", field + "["))]
    if under:  # all of the media, say: the first of them
        return under[0]
    return fields.get("prompt")


def from_omni_error(err: OmniError, fields: Mapping[str, str],
                    sampling_param: Callable[[str, str], str] | None = None) -> ApiError:
    """A typed omni error (raised at submission, or a failed request's error) as an ApiError, by table."""
    status, kind = _CODE_STATUS.get(err.code) or next(
        _STATUS[c] for c in type(err).__mro__ if c in _STATUS)
    param = request_param(err.field, err.stage, fields, sampling_param) if status == 400 else None
    message = err.message if status < 500 or isinstance(err, RequestTimeoutError) else (
        f"the pipeline failed this request: {err.message}")
    return ApiError(status, message, type=kind, param=param, code=err.code)
