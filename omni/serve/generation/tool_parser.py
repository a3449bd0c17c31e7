"""tool_choice "auto": a text reply or tool calls, read from the model's own tool-call format (vLLM's
`--enable-auto-tool-choice --tool-call-parser hermes`).

The Hermes format, which Qwen2.5 / Qwen3 chat templates teach their models (the templates render the tools into the
system prompt and ask for calls in this form):

    Let me look that up.                                          <- content (what precedes the first call)
    <tool_call>
    {"name": "get_weather", "arguments": {"unit": "c", "days": 2}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "utc"}}             <- a last call may lack its closing tag
    </tool_call>                                                     (the reply ended at max_tokens or a stop)

A reply with at least one `<tool_call>` whose every block is a JSON object with a string "name" comes back as those
calls (arguments as JSON text, as OpenAI sends them), finish_reason "tool_calls", and the text before the first call
as content (None when blank); text after the calls is dropped, as vLLM does. A block that is not such an object makes
the whole reply plain text: a malformed call is shown, not half-used.

Streamed, the content before the first `<tool_call>` goes out as it comes (held back only while the text could be
the start of the tag); from the tag on, the reply is held to its end and then sent as the calls, or as text if it
is not calls: a stream always ends with exactly what the non-streamed reply holds.
"""
from __future__ import annotations

import json
import re
from typing import Any

from omni.serve.generation.tools import new_call

PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _arguments(value: Any) -> str:
    if isinstance(value, str):  # already JSON text (some models write it so): kept when it is an object
        try:
            if isinstance(json.loads(value), dict):
                return value
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, calls) of a whole reply; calls None when the reply is text (its content: all of it)."""
    start = text.find(START)
    if start < 0:
        return text, None
    calls = []
    for m in _BLOCK.finditer(text, start):
        body = m.group(1) if m.group(1) is not None else m.group(2)
        try:
            value = json.loads(body)
        except ValueError:
            return text, None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return text, None
        calls.append(new_call(value["name"], _arguments(value.get("arguments", {}))))
    content = text[:start]
    return (content if content.strip() else None), calls


def _partial_start(text: str) -> int:
    """Length of the longest end of `text` that begins the start tag (it may be completed by what comes next)."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """One streamed reply: `feed(text)` -> the content to send now; `finish()` -> (the rest of the content, calls
    or None), once the reply has ended."""

    def __init__(self) -> None:
        self._pending = ""  # an end of the text that may begin the start tag
        self._held: str | None = None  # from the first start tag on

    def feed(self, text: str) -> str:
        if self._held is not None:
            self._held += text
            return ""
        text = self._pending + text
        at = text.find(START)
        if at >= 0:
            self._pending, self._held = "", text[at:]
            return text[:at]
        keep = _partial_start(text)
        self._pending = text[len(text) - keep:]
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, list[dict[str, Any]] | None]:
        if self._held is None:
            rest, self._pending = self._pending, ""
            return rest, None
        held, self._held = self._held, None
        _, calls = parse_tool_calls(held)
        return ("", calls) if calls is not None else (held, None)
