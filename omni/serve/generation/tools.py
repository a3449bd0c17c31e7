"""Chat tool calls (OpenAI's `tools` / `tool_choice`), as vLLM serves them.

    tools                     the text stage's chat template shows them to the model (StageInput.tools ->
                              apply_chat_template(..., tools=...)); a stage with its own prompt renderer (the
                              omni thinkers) refuses them, naming `tools`
    tool_choice "required"    the reply is constrained (structured outputs) to a JSON list of one call or more,
                              [{"name": one of the tools, "parameters": its schema}] (one call at most with
                              parallel_tool_calls false), and comes back as `tool_calls`, finish_reason
                              "tool_calls"
    tool_choice {"function"}  the reply is constrained to that function's parameters (a JSON object) and comes
                              back as one call of it, finish_reason "stop" (OpenAI's, for a named choice)
    tool_choice "none"        a text reply (the tools still shown to the model, as vLLM does by default)
    "auto" (the default)      text or calls, read from the reply in the model's own format
                              (generation/tool_parser.py) by a server started with --enable-auto-tool-choice --tool-call-parser hermes; without
                              them refused, naming tool_choice (as vLLM)

Earlier turns' calls and their results go back to the template as it expects them: an assistant message's
`tool_calls` with their arguments as objects (OpenAI sends them as JSON text), a `tool` message with its
`tool_call_id`. A reply cut short by max_tokens is not a complete call: it comes back as text, with
finish_reason "length".
"""
from __future__ import annotations

import json
import uuid
from typing import Any

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def template_tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's tool calls (protocol.ToolCall) as chat templates read them: arguments as objects."""
    return [{"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in calls]


def call_schema(forced: str, functions: list[tuple[str, dict[str, Any] | None]],
                parallel: bool | None = None) -> dict[str, Any]:
    """The JSON schema a forced reply follows (see the module docstring); `functions`: the tools' (name,
    parameters schema or None), `parallel` False: one call at most."""
    if forced != "required":
        (parameters,) = [p for name, p in functions if name == forced]
        return parameters if parameters is not None else _ANY_OBJECT
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "parameters": p if p is not None else _ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for name, p in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def force_call(job: Any, forced: str, functions: list[tuple[str, dict[str, Any] | None]], parallel: bool | None,
               field: str) -> None:
    """Constrain the text stage's reply to the forced call's JSON (structured outputs); errors of that
    constraint (a tool's parameters that are no JSON schema it can follow) name `field`."""
    stage = job.text_stage or job.usage_stage
    job.sampling.setdefault(stage, {})["structured_outputs"] = {"json": call_schema(forced, functions, parallel)}
    job.fields["structured_outputs"] = field
    job.forced_tool = forced


def force_tool_call(req: Any, job: Any) -> None:
    """Chat completions' forced tool_choice (its tools' schemas are what a constraint error is about)."""
    functions = [(t.function.name, t.function.parameters) for t in req.tools]
    force_call(job, req.forced_tool, functions, req.parallel_tool_calls, "tools")


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI tool call (arguments: JSON text)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def reply_tool_calls(forced: str | None, text: str, finish_reason: str | None
                     ) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(tool_calls, finish_reason) of a reply; (None, finish_reason) when it is text: no forced call, or a
    reply that is not a complete one (cut short)."""
    if forced is None or finish_reason == "length":
        return None, finish_reason
    try:
        value = json.loads(text)
    except ValueError:
        return None, finish_reason
    if forced != "required":
        return ([new_call(forced, text)], finish_reason) if isinstance(value, dict) else (None, finish_reason)
    if not isinstance(value, list) or not value:
        return None, finish_reason
    calls = [new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False, separators=(",", ":")))
             for c in value if isinstance(c, dict) and "name" in c and "parameters" in c]
    return (calls, "tool_calls") if len(calls) == len(value) else (None, finish_reason)
