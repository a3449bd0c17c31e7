"""The shape of `SamplingParams.structured_outputs` (no torch, no tokenizer: checked at the edge).

Exactly one constraint, as vLLM's StructuredOutputsParams names them; compiling it against a stage's
tokenizer is the engine's (omni/engine/io/structured_output.py).
"""
from __future__ import annotations

import json
from typing import Any

KINDS = ("json", "json_object", "regex", "choice")


def spec_error(text: str) -> ValueError:
    return ValueError(f"structured_outputs: {text}; give exactly one of {', '.join(KINDS)}")


def check_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's shape (no tokenizer needed): exactly one known key with a value of its kind. A `json` schema may
    come as a JSON string (vLLM accepts both); it is parsed here."""
    keys = [k for k, v in spec.items() if v is not None and v is not False]
    unknown = sorted(set(spec) - set(KINDS))
    if unknown:
        raise spec_error(f"unknown key {unknown[0]!r}")
    if len(keys) != 1:
        raise spec_error(f"got {len(keys)} constraints ({', '.join(keys) or 'none'})")
    kind, value = keys[0], spec[keys[0]]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise spec_error(f"json: not a JSON schema ({e.msg} at character {e.pos})") from None
        if not isinstance(value, (dict, bool)):
            raise spec_error(f"json: a JSON schema is an object, got {type(value).__name__}")
    elif kind == "json_object" and value is not True:
        raise spec_error("json_object: must be true")
    elif kind == "regex" and (not isinstance(value, str) or not value):
        raise spec_error("regex: a non-empty string")
    elif kind == "choice" and (not isinstance(value, list) or not value
                               or not all(isinstance(c, str) and c for c in value)):
        raise spec_error("choice: a non-empty list of non-empty strings")
    return {kind: value}
