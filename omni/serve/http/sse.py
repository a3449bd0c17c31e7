"""Server-sent events, one way for every endpoint: an event is one compact JSON `data:` line; an error once the
status line is gone is an `error` event; a stream pings every 15 s so that proxies keep it open."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse

from omni.serve.http.errors import ApiError

PING_S = 15
DONE = {"data": "[DONE]"}  # how chat and completions streams end (OpenAI's)


def sse_event(payload: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(payload, separators=(",", ":"))}


def sse_error(err: ApiError) -> dict[str, str]:
    """An error event as the audio endpoints send it: `{"type": "error", "error": {...}}`."""
    return sse_event({"type": "error", **err.body()})


def sse_response(events: AsyncIterator[dict[str, str]]) -> EventSourceResponse:
    return EventSourceResponse(events, sep="\n", ping=PING_S)
