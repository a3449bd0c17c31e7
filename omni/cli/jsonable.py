"""The one JSON form every subcommand prints (`--json`, results.jsonl, a benchmark's last line):
numpy arrays and scalars as lists and numbers, pydantic models as their dumps, sets as lists."""
from __future__ import annotations

import json
from typing import Any

import numpy as np


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    if hasattr(o, "model_dump"):
        return o.model_dump()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=_jsonable, separators=(",", ":"))
