"""What went wrong on Ray, in one line: the original error of a failed task, or the first line of Ray's
own (multi-line, colored) message. Both the stage actors (an upstream output they could not fetch) and
the driver (a replica that died, a reply that did not come) word their errors with it."""
from __future__ import annotations

import re

from ray.exceptions import RayActorError, RayTaskError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(text: str, limit: int = 400) -> str:
    lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def describe(e: BaseException) -> str:
    """What went wrong, by the exception's type: the original error of a failed task, the first line
    of Ray's own message otherwise."""
    if isinstance(e, RayTaskError) and e.cause is not None:
        return f"{type(e.cause).__name__}: {_first_line(str(e.cause))}"
    if isinstance(e, RayActorError):
        return _first_line(e.error_msg) or type(e).__name__
    return f"{type(e).__name__}: {_first_line(str(e))}"
