"""Pydantic's validation errors in the user's words: field paths, and what a union field takes.

Where a union's member failed, pydantic puts the member's name into the error's loc: its validator
(`list[str]`, `literal['none','auto']`, `function-after[_check(), str]`, `typed-dict`), its type (`str`,
`int`) or its model's class (`NamedToolChoice`, `InputEdge`). None of them is a field the user wrote, and
each member reports its own complaint, so a value no member takes reads as several unrelated errors
(`inputs.0.str: ...; inputs.0.InputEdge: ...`). Here such a value is one problem of the field, worded as
what the field takes (`expected a string or an object (got 5)`); a value shaped like one member (a list
for `str | list[str]`) keeps that member's own error, its name dropped from the path.

Pydantic only: the HTTP server (omni/serve/http/errors.py: OpenAI error bodies) and the config loader
(omni/config/loader.py: one-line config errors) both render from here. No message is ever parsed.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

_SCALARS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "bytes": "a string",
            "none": "null", "decimal": "a number"}
_PLURALS = {"str": "strings", "int": "integers", "float": "numbers", "bool": "booleans", "bytes": "strings",
            "decimal": "numbers"}
_WRAPPERS = ("function-", "nullable[", "default[", "lax-or-strict[", "json-or-python[")
# errors that say a value is not of a member's type at all (rather than a right-shaped value with a bad part)
_NOT_THIS_TYPE = {"literal_error", "enum", "none_required", "is_instance_of", "union_tag_invalid",
                  "union_tag_not_found"}
UNION_ERROR = "union_accepts"  # accepts(): no member of a union took the value; its ctx says what the field takes

Errors = list[dict[str, Any]]
UnionErrors = tuple[int, dict[str, Errors]]  # where the members' names are in the loc, and each member's errors


def _always_member(part: Any) -> bool:
    """A validator's name (or a dict key's `[key]`): never a field's."""
    return isinstance(part, str) and ("[" in part or part.startswith("function-"))


def _member_like(part: Any) -> bool:
    """What a union member's name looks like: a validator's name, a type's, a model class's (CamelCase)."""
    return isinstance(part, str) and bool(part) and (_always_member(part) or part in _SCALARS or "-" in part or (
        part.lstrip("_")[:1].isupper() and part.isidentifier()))


def user_loc(loc: tuple[Any, ...], tags: frozenset[str] = frozenset(),
             members: frozenset[int] | None = None) -> tuple[Any, ...]:
    """`loc` without what the user did not write: union members' names and validator wrappers.

    `tags`: discriminator values pydantic puts into the path of a tagged union (dropped after an index).
    `members`: the positions in `loc` known to name a union's member (resolve() finds them); without it,
    every part that looks like a member's name (`str`, `list[str]`, `NamedToolChoice`) is dropped."""
    out: list[Any] = []
    after_index = False
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out.append(part)
            after_index = True
            continue
        if after_index and part in tags:
            after_index = False
            continue
        after_index = False
        if _always_member(part) or (i in members if members is not None else _member_like(part)):
            continue
        out.append(part)
    return tuple(out)


def render(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def loc_to_param(loc: tuple[Any, ...], tags: frozenset[str] = frozenset(),
                 members: frozenset[int] | None = None) -> str:
    """('messages', 0, 'content', 1, 'image_url', 'url') -> 'messages[0].content[1].image_url.url', without
    union members' names (see user_loc)."""
    return render(user_loc(loc, tags, members))


def wrong_type(e: dict[str, Any]) -> bool:
    """An object's `type` that is none of the ones this field takes (its other errors follow from it)."""
    return e["type"] == "literal_error" and e["loc"][-1:] == ("type",)


def _first(errors: Errors) -> dict[str, Any]:
    """The error to report: a wrong `type` first, then an unknown field, then pydantic's first."""
    return next((x for x in errors if wrong_type(x)), None) or next(
        (x for x in errors if x["type"] == "extra_forbidden"), errors[0])


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain truth value (an array) is not the same here
        return False


def _union_at(errors: Errors, loc: tuple[Any, ...], start: int) -> UnionErrors | None:
    """The first union on `loc`'s path from `start`: its position (where the members' names are) and each
    member's errors. A union's members all fail, so two or more of them name themselves at the same place;
    those that refuse the value as a whole (their error sits right at that place) were all given the one
    value, which tells a union from a mapping's keys that look like members' names (`{TPU: x, HPU: y}`)."""
    for p in range(start, len(loc)):
        if not _member_like(loc[p]):
            continue
        by: dict[str, Errors] = {}
        for x in errors:
            if len(x["loc"]) > p and tuple(x["loc"][:p]) == tuple(loc[:p]) and _member_like(x["loc"][p]):
                by.setdefault(x["loc"][p], []).append(x)
        whole = [x["input"] for xs in by.values() for x in xs if len(x["loc"]) == p + 1]
        if len(by) > 1 and all(_same(whole[0], v) for v in whole[1:]):
            return p, by
    return None


def _has_its_shape(errors: Errors, p: int) -> bool:
    """A union member the value is shaped like: it failed inside (an item, a field, a constraint), not on
    the value's type (a string for a list; in lax mode, a string that reads as no number: `*_parsing`) nor
    on an object's `type`."""
    return not any(len(x["loc"]) == p + 1 and (x["type"].endswith(("_type", "_parsing"))
                                               or x["type"] in _NOT_THIS_TYPE)
                   or len(x["loc"]) == p + 2 and wrong_type(x) for x in errors)


def resolve(errors: Errors, start: int = 0,
            members: tuple[int, ...] = ()) -> tuple[dict[str, Any], frozenset[int], UnionErrors | None]:
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
        return resolve(shaped[0], p + 1, (*members, p))
    return e, frozenset((*members, p)), union


@dataclass(frozen=True)
class Problem:
    """One problem of the input: `error` is pydantic's error to report (for a union no member took: its
    first member's), `members` the positions of union members' names on its loc, `union` that union."""

    error: dict[str, Any]
    members: frozenset[int]
    union: UnionErrors | None

    @property
    def loc(self) -> tuple[Any, ...]:
        """Where the problem is: the union's field itself, when no member took the value."""
        loc = tuple(self.error["loc"])
        return loc[:self.union[0]] if self.union is not None else loc

    def user_loc(self, tags: frozenset[str] = frozenset()) -> tuple[Any, ...]:
        """`loc` as the user wrote it: ('stages', 0, 'inputs', 0), no union member's name."""
        return user_loc(self.loc, tags, self.members)

    def path(self, tags: frozenset[str] = frozenset()) -> str:
        """The field as the user wrote it: `inputs[0]`, `cache.memory_budget_mb`."""
        return render(self.user_loc(tags))


def problems(errors: Errors, start: int = 0, members: tuple[int, ...] = ()) -> list[Problem]:
    """Every problem of a ValidationError's errors, in pydantic's order: each union none of whose members
    took its value is one problem (not one per member); a union whose value is shaped like one member gives
    that member's problems. resolve() is the first of them by priority (what an API reports alone)."""
    order = {id(x): i for i, x in enumerate(errors)}
    out: list[tuple[int, Problem]] = []
    remaining = list(errors)
    while remaining:
        e = remaining[0]
        union = _union_at(remaining, tuple(e["loc"]), start)
        if union is None:
            out.append((order[id(e)], Problem(e, frozenset(members), None)))
            remaining = remaining[1:]
            continue
        p, by = union
        taken = {id(x) for xs in by.values() for x in xs}
        remaining = [x for x in remaining if id(x) not in taken]
        shaped = [xs for xs in by.values() if _has_its_shape(xs, p)]
        if len(shaped) == 1:
            out.extend((order[id(q.error)], q) for q in problems(shaped[0], p + 1, (*members, p)))
        else:
            out.append((order[id(e)], Problem(e, frozenset((*members, p)), union)))
    return [q for _, q in sorted(out, key=lambda item: item[0])]


def _literal_values(label: str) -> list[str]:
    """literal['none','auto'] -> ['"none"', '"auto"']."""
    try:
        values = ast.literal_eval(f"[{label[len('literal['):-1]}]")
    except (ValueError, SyntaxError):
        return [label]
    return [json.dumps(v) for v in values]


def _describe(label: str, errors: Errors, p: int) -> list[str]:
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
    types = [x for x in errors if len(x["loc"]) == p + 2 and wrong_type(x)]
    if types and "expected" in types[0].get("ctx", {}):
        return [f"an object of type {types[0]['ctx']['expected']}".replace("'", '"')]
    return ["an object"] if label.lstrip("_")[:1].isupper() else [label]


def _one_of(alternatives: list[str]) -> str:
    alternatives = list(dict.fromkeys(alternatives))
    return alternatives[0] if len(alternatives) == 1 else f"{', '.join(alternatives[:-1])} or {alternatives[-1]}"


def shown(value: Any, width: int = 60) -> str:
    """A value as the user wrote it (JSON), cut short to `width` characters: every message that echoes a value
    shortens it here."""
    try:
        return cut(json.dumps(value), width, '"')
    except (TypeError, ValueError):
        return cut(repr(value), width, "'\"")


def cut(text: str, width: int, quotes: str = '"') -> str:
    """`text` (JSON, or a repr with `quotes`) in at most `width` characters, the cut marked by `…`. A string the
    cut falls in is closed after the mark (`"aaaa…"`) and no escape sequence is split: a plain slice dropped the
    closing quote, and the reader could not tell where the shown value ends."""
    if len(text) <= width:
        return text
    kept = text[:max(width - 2, 1)]
    quote, escape = "", -1  # the string the cut falls in (its quote), where its last escape starts
    i = 0
    while i < len(kept):
        ch = kept[i]
        if quote and ch == "\\":
            escape = i
            i += 6 if kept[i + 1:i + 2] == "u" else 2  # \uXXXX, or \n, \", ...
            continue
        if quote and ch == quote:
            quote = ""
        elif not quote and ch in quotes:
            quote = ch
        i += 1
    if quote and i > len(kept):  # the last escape runs past the cut: leave it out whole
        kept = kept[:escape]
    return f"{kept}…{quote}"


def got(value: Any) -> str:
    """` (got ...)` for a message: a scalar as is (JSON), an object by its `type`."""
    if isinstance(value, dict):
        kind = value.get("type")
        return f" (got an object of type {shown(kind)})" if isinstance(kind, str) else ""
    return "" if isinstance(value, list) else f" (got {shown(value)})"


def union_message(union: UnionErrors) -> str:
    """`expected a number or "auto" (got "lots")`: what a union field takes, and the value none of it took."""
    p, by = union
    inputs = [x["input"] for xs in by.values() for x in xs if len(x["loc"]) == p + 1]
    what = _one_of([a for label, xs in by.items() for a in _describe(label, xs, p)])
    return f"expected {what}{got(inputs[0]) if inputs else ''}"


def accepts(what: str) -> WrapValidator:
    """A union field's own words for what it takes (`Annotated[str | list[str] | None, accepts("a string or a
    list of strings")]`): when none of its members takes the value, the error says so, naming the field
    alone, instead of the members' complaints. A value shaped like one member keeps that member's error."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as err:
            _, _, union = resolve(err.errors())
            if union is None or union[0] != 0:
                raise
            raise PydanticCustomError(UNION_ERROR, "expected {accepts}", {"accepts": what}) from None

    return WrapValidator(validate)
