"""The one base of every request model `omni serve` accepts, and the checks they share.

RequestModel is strict (no "0.5" for a number, no true for an int; JSON ints are still accepted for floats) and
refuses unknown fields. A model whose values arrive as text (a multipart form) or whose protocol coerces as
pydantic's lax mode does (the Realtime events, as before) says so with its own `model_config = ConfigDict(strict=
False)`: the one setting that differs, written where it differs.

A field this server does not implement is known and accepted only at the values that ask for nothing (null, its
default): `unsupported` says why any other value is refused; `check_unsupported` applies a table of them.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

from omni.config.pydantic_errors import shown
from omni.errors import FIELD_ERROR


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def field_error(field: str, text: str, code: str = "invalid_value") -> PydanticCustomError:
    """A model validator's error naming its field (and code) as data (errors.from_validation_error reads it)."""
    return PydanticCustomError(FIELD_ERROR, "{field}: {text}", {"field": field, "text": text, "code": code})


def _same(value: Any, accepted: Any) -> bool:
    """JSON equality without Python's bool/int mixing (`false` is not 0) and with 0 == 0.0."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    return value == accepted and type(value) in (type(accepted), int, float)



def unsupported(value: Any, accepted: tuple[Any, ...]) -> str | None:
    """Why `value` of a field this server does not implement is refused (None: it asks for nothing)."""
    if any(_same(value, a) for a in accepted):
        return None
    nothing = ", ".join("null" if a is None else json.dumps(a) for a in accepted)
    return f"this server does not implement it: send it absent or as {nothing} (got {shown(value)})"


def check_unsupported(req: BaseModel, table: dict[str, tuple[Any, ...]]) -> None:
    """A model validator's check of its unimplemented fields (name -> the values that ask for nothing)."""
    for name, accepted in table.items():
        why = unsupported(getattr(req, name), accepted)
        if why is not None:
            raise field_error(name, why, "unsupported_parameter")


def whole_number(v: Any) -> Any:
    """A JSON number with no fraction (5.0, 1e2) taken for an integer field, as vLLM's (lax) pydantic takes it:
    JavaScript and YAML clients write numbers as floats. Strings and booleans stay refused."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


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

