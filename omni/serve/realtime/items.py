"""Items a `/v1/realtime` client sends (`conversation.item.create`, a response's own `input`) as the conversation
keeps them: text parts, input audio at the model's rate (decoded in the session's input format), checked part by
part (an error names the part)."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from omni.config.pydantic_errors import loc_to_param
from omni.serve.protocol import realtime as E
from omni.serve.protocol.realtime import RealtimeEventError
from omni.serve.realtime.conversation import ConvItem, Conversation, Part, new_item_id
from omni.serve.realtime.input_audio import InputAudio


async def client_item(it: E.Item, at: str, eid: str | None, input_audio: InputAudio, rate: int) -> ConvItem:
    """A client's item (`at`: where the event holds it, for the errors' param) as the conversation keeps it."""
    parts = []
    allowed = {"user": ("input_text", "input_audio"), "system": ("input_text",),
               "assistant": ("output_text", "output_audio", "text")}[it.role]
    for j, c in enumerate(it.content):
        where = f"{at}.content[{j}]"
        if c.type not in allowed:
            raise RealtimeEventError(f"{where}.type: a {it.role} item holds {' or '.join(allowed)} parts, not "
                                     f"{c.type}", f"{where}.type", "invalid_value", eid)
        if c.type == "input_audio":
            if not c.audio:
                raise RealtimeEventError(f"{where}.audio: an input_audio part needs its audio (base64 pcm16 at "
                                         "24 kHz)", f"{where}.audio", "missing_required_parameter", eid)
            wave = await input_audio.item_audio(c.audio, f"{where}.audio", eid, rate)
            parts.append(Part("input_audio", audio=wave, audio_rate=rate))
        else:
            text = c.text if c.text is not None else c.transcript
            if text is None:
                raise RealtimeEventError(f"{where}.text: a {c.type} part needs its text", f"{where}.text",
                                         "missing_required_parameter", eid)
            parts.append(Part(c.type, text=text))
    return ConvItem(it.id or new_item_id(), it.role, parts)

async def response_context(entries: list[dict[str, Any]], eid: str | None, conversation: Conversation,
                           input_audio: InputAudio, rate: int) -> Conversation:
    """A response's own `input`: its items, or references to the conversation's, in order."""
    context = Conversation()
    for i, raw in enumerate(entries):
        at = f"response.input[{i}]"
        if raw.get("type") == "item_reference":
            ref = raw.get("id")
            item = conversation.find(ref) if isinstance(ref, str) else None
            if item is None:
                raise RealtimeEventError(f"{at}.id: no item {ref!r} in the conversation", f"{at}.id",
                                         "item_not_found", eid)
            context.items.append(item)
            continue
        try:
            it = E.Item.model_validate(raw)  # (calls and their outputs: reference them from the conversation)
        except ValidationError as err:
            e = err.errors()[0]
            param = f"{at}.{loc_to_param(tuple(e['loc']))}"
            raise RealtimeEventError(f"{param}: {e['msg']}", param, "invalid_value", eid) from None
        context.items.append(await client_item(it, at, eid, input_audio, rate))
    return context
