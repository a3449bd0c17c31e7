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

import ast
import json
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from omni.errors import (FIELD_ERROR, BackendClosedError, OmniError, RequestAbortedError, RequestError, RequestTimeoutError,
                         StageError)

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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def too_large(message: str, param: str | None = None) -> ApiError:
    return ApiError(413, message, param=param, code="request_too_large")


def internal(message: str) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")


# ------------------------------------------------------------------ pydantic
# Where a union's member failed, pydantic puts the member's name into the error's loc: its validator
# (`list[str]`, `literal['none','auto']`, `function-after[_check(), str]`, `typed-dict`), its type (`str`,
# `int`) or its model's class (`NamedToolChoice`). None of them is a field the user wrote.
_SCALARS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "bytes": "a string",
            "none": "null", "decimal": "a number"}
_PLURALS = {"str": "strings", "int": "integers", "float": "numbers", "bool": "booleans", "bytes": "strings",
            "decimal": "numbers"}
_WRAPPERS = ("function-", "nullable[", "default[", "lax-or-strict[", "json-or-python[")
# errors that say a value is not of a member's type at all (rather than a right-shaped value with a bad part)
_NOT_THIS_TYPE = {"literal_error", "enum", "none_required", "is_instance_of", "union_tag_invalid",
                  "union_tag_not_found"}
UNION_ERROR = "union_accepts"  # accepts(): no member of a union took the value; its ctx says what the field takes


def _always_member(part: Any) -> bool:
    """A validator's name (or a dict key's `[key]`): never a field's."""
    return isinstance(part, str) and ("[" in part or part.startswith("function-"))


def _member_like(part: Any) -> bool:
    """What a union member's name looks like: a validator's name, a type's, a model class's (CamelCase)."""
    return isinstance(part, str) and bool(part) and (_always_member(part) or part in _SCALARS or "-" in part or (
        part.lstrip("_")[:1].isupper() and part.isidentifier()))


def loc_to_param(loc: tuple[Any, ...], tags: frozenset[str] = frozenset(),
                 members: frozenset[int] | None = None) -> str:
    """('messages', 0, 'content', 1, 'image_url', 'url') -> 'messages[0].content[1].image_url.url'.

    `tags`: discriminator values pydantic puts into the path of a tagged union (dropped after an index).
    `members`: the positions in `loc` known to name a union's member (from_validation_error finds them);
    without it, every part that looks like a member's name (`str`, `list[str]`, `NamedToolChoice`) is dropped."""
    out = ""
    after_index = False
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            after_index = True
            continue
        if after_index and part in tags:
            after_index = False
            continue
        after_index = False
        if _always_member(part) or (i in members if members is not None else _member_like(part)):
            continue  # union members' names, validator wrappers
        out += f".{part}" if out else part
    return out


def _wrong_type(e: dict[str, Any]) -> bool:
    """An object's `type` that is none of the ones this field takes (its other errors follow from it)."""
    return e["type"] == "literal_error" and e["loc"][-1:] == ("type",)


def _first(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report: a wrong `type` first, then an unknown field, then pydantic's first."""
    return next((x for x in errors if _wrong_type(x)), None) or next(
        (x for x in errors if x["type"] == "extra_forbidden"), errors[0])


def _union_at(errors: list[dict[str, Any]], loc: tuple[Any, ...],
              start: int) -> tuple[int, dict[str, list[dict[str, Any]]]] | None:
    """The first union on `loc`'s path from `start`: its position (where the members' names are) and each
    member's errors. A union's members all fail, so two or more of them name themselves at the same place."""
    for p in range(start, len(loc)):
        if not _member_like(loc[p]):
            continue
        by: dict[str, list[dict[str, Any]]] = {}
        for x in errors:
            if len(x["loc"]) > p and tuple(x["loc"][:p]) == tuple(loc[:p]) and _member_like(x["loc"][p]):
                by.setdefault(x["loc"][p], []).append(x)
        if len(by) > 1:
            return p, by
    return None


def _has_its_shape(errors: list[dict[str, Any]], p: int) -> bool:
    """A union member the value is shaped like: it failed inside (an item, a field, a constraint), not on
    the value's type (a string for a list) nor on an object's `type`."""
    return not any(len(x["loc"]) == p + 1 and (x["type"].endswith("_type") or x["type"] in _NOT_THIS_TYPE)
                   or len(x["loc"]) == p + 2 and _wrong_type(x) for x in errors)


def _resolve(errors: list[dict[str, Any]], start: int = 0, members: tuple[int, ...] = ()) -> tuple[
        dict[str, Any], frozenset[int], tuple[int, dict[str, list[dict[str, Any]]]] | None]:
    """The error to report, the positions of union members' names on its path, and the union none of whose
    members took the value (None: the error is a field's own). Where exactly one member is shaped like the
    value (`["a", 3]` for `str | list[str]`), that member's error is the one: `stop[1]`."""
    e = _first(errors)
    union = _union_at(errors, tuple(e["loc"]), start)
    if union is None:
        return e, frozenset(members), None
    p, by = union
    shaped = [xs for xs in by.values() if _has_its_shape(xs, p)]
    if len(shaped) == 1:
        return _resolve(shaped[0], p + 1, (*members, p))
    return e, frozenset((*members, p)), union


def _literal_values(label: str) -> list[str]:
    """literal['none','auto'] -> ['"none"', '"auto"']."""
    try:
        values = ast.literal_eval(f"[{label[len('literal['):-1]}]")
    except (ValueError, SyntaxError):
        return [label]
    return [json.dumps(v) for v in values]


def _describe(label: str, errors: list[dict[str, Any]], p: int) -> list[str]:
    """What a union member takes, in words (one entry per alternative)."""
    if label in _SCALARS:
        return [_SCALARS[label]]
    if label.startswith("literal["):
        return _literal_values(label)
    if label.startswith(_WRAPPERS) and label.endswith("]"):  # function-after[_check(), str] -> str
        inner = label[label.index("[") + 1:-1]
        return _describe(inner.split(", ", 1)[-1] if label.startswith("function-") else inner, errors, p)
    for kind in ("list[", "tuple[", "set[", "frozenset["):
        if label.startswith(kind) and label.endswith("]"):
            item = label[len(kind):-1]
            return [f"a list of {_PLURALS.get(item, 'objects' if item.lstrip('_')[:1].isupper() else 'items')}"]
    if label.startswith("dict[") or label == "typed-dict":
        return ["an object"]
    types = [x for x in errors if len(x["loc"]) == p + 2 and _wrong_type(x)]
    if types and "expected" in types[0].get("ctx", {}):
        return [f"an object of type {types[0]['ctx']['expected']}".replace("'", '"')]
    return ["an object"] if label.lstrip("_")[:1].isupper() else [label]


def _one_of(alternatives: list[str]) -> str:
    alternatives = list(dict.fromkeys(alternatives))
    return alternatives[0] if len(alternatives) == 1 else f"{', '.join(alternatives[:-1])} or {alternatives[-1]}"


def _shown(value: Any) -> str:
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def _got(value: Any) -> str:
    """` (got ...)` for a message: a scalar as is (JSON), an object by its `type`."""
    if isinstance(value, dict):
        kind = value.get("type")
        return f" (got an object of type {_shown(kind)})" if isinstance(kind, str) else ""
    return "" if isinstance(value, list) else f" (got {_shown(value)})"


def accepts(what: str) -> WrapValidator:
    """A union field's own words for what it takes (`Annotated[str | list[str] | None, accepts("a string or a
    list of strings")]`): when none of its members takes the value, the error says so, naming the field
    alone, instead of the members' complaints. A value shaped like one member keeps that member's error."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as err:
            _, _, union = _resolve(err.errors())
            if union is None or union[0] != 0:
                raise
            raise PydanticCustomError(UNION_ERROR, "expected {accepts}", {"accepts": what}) from None

    return WrapValidator(validate)


def from_validation_error(err: ValidationError, tags: frozenset[str] = frozenset()) -> ApiError:
    """The first problem pydantic found, naming its field (as the user wrote it: no union member's name)."""
    e, members, union = _resolve(err.errors())
    loc = tuple(e["loc"])
    if union is not None:  # no member of a union took the value: say what the field takes
        p, by = union
        param = loc_to_param(loc[:p], tags, members) or None
        inputs = [x["input"] for xs in by.values() for x in xs if len(x["loc"]) == p + 1]
        what = _one_of([a for label, xs in by.items() for a in _describe(label, xs, p)])
        msg = f"expected {what}{_got(inputs[0]) if inputs else ''}"
        return bad_request(f"{param}: {msg}" if param else msg, param, "invalid_value")
    param = loc_to_param(loc, tags, members) or None
    if e["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if e["type"] == "missing":
        return bad_request(f"{param}: required field is missing", param, "missing_required_parameter")
    if e["type"] == UNION_ERROR:
        msg = f"{e['msg']}{_got(e.get('input'))}"
        return bad_request(f"{param}: {msg}" if param else msg, param, "invalid_value")
    if _wrong_type(e):
        expected = e.get("ctx", {}).get("expected", "").replace("'", '"')
        msg = f"type {_shown(e.get('input'))} is not supported (only {expected})"
        return bad_request(f"{param}: {msg}" if param else msg, param, "invalid_value")
    msg = e["msg"].removeprefix("Value error, ")
    code = "invalid_value"
    if e["type"] == FIELD_ERROR:  # a model validator naming its field (as data: protocol.field_error)
        field = e["ctx"]["field"]
        param = f"{param}.{field}" if param else field
        msg = e["ctx"]["text"]
        code = e["ctx"].get("code", code)
    shown = repr(e.get("input"))
    got = f" (got {shown[:60]})" if not isinstance(e.get("input"), (dict, list)) else ""
    return bad_request(f"{param}: {msg}{got}" if param else msg, param, code)


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
