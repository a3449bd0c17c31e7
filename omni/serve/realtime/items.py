"""Items a `/v1/realtime` client sends (`conversation.item.create`, a response's own `input`) as the conversation
keeps them: text parts, input audio at the model's rate (decoded in the session's input format) and input images,
checked part by part (an error names the part).

An `input_image` part (GA: `{"type": "input_image", "image_url": "data:image/png;base64,...", "detail"}`) is read
as chat completions read an `image_url` (omni/serve/media.py: a data: URL only, its decoded size bounded by
--max-media-mb before any pixel is decoded), off the event loop. A pipeline whose model takes no images refuses
it at once, naming the part's type; a conversation (or a response's input) holds at most --max-media-items images.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from omni.config.pydantic_errors import loc_to_param
from omni.serve.http.errors import ApiError
from omni.serve.media import decode_image, parse_data_url
from omni.serve.protocol import realtime as E
from omni.serve.protocol.realtime import RealtimeEventError
from omni.serve.realtime.conversation import ConvItem, Conversation, Part, new_item_id

if TYPE_CHECKING:
    from omni.serve.realtime.session import Session

ALLOWED = {"user": ("input_text", "input_audio", "input_image"), "system": ("input_text",),
           "assistant": ("output_text", "output_audio", "text")}


async def client_item(it: E.Item, at: str, eid: str | None, session: Session, joins: Conversation) -> ConvItem:
    """A client's item (`at`: where the event holds it, for the errors' param) as the conversation keeps it;
    `joins`: the conversation it joins (the session's, or a response's own input), whose images count."""
    parts = []
    allowed = ALLOWED[it.role]
    images = sum(i.images for i in joins.items)
    for j, c in enumerate(it.content):
        where = f"{at}.content[{j}]"
        if c.type not in allowed:
            raise RealtimeEventError(f"{where}.type: a {it.role} item holds {' or '.join(allowed)} parts, not "
                                     f"{c.type}", f"{where}.type", "invalid_value", eid)
        if c.type == "input_audio":
            if not c.audio:
                raise RealtimeEventError(f"{where}.audio: an input_audio part needs its audio (base64 pcm16 at "
                                         "24 kHz)", f"{where}.audio", "missing_required_parameter", eid)
            rate = session.server.settings.audio_input_rate
            wave = await session.input_audio.item_audio(c.audio, f"{where}.audio", eid, rate)
            parts.append(Part("input_audio", audio=wave, audio_rate=rate))
        elif c.type == "input_image":
            images += 1
            image = await _image(c, where, eid, session, images, "the conversation" if joins is
                                 session.conversation else "response.input")
            parts.append(Part("input_image", image=image, detail=c.detail or "auto"))
        else:
            text = c.text if c.text is not None else c.transcript
            if text is None:
                raise RealtimeEventError(f"{where}.text: a {c.type} part needs its text", f"{where}.text",
                                         "missing_required_parameter", eid)
            parts.append(Part(c.type, text=text))
    return ConvItem(it.id or new_item_id(), it.role, parts)


async def _image(c: E.ContentPart, where: str, eid: str | None, session: Session, count: int,
                 whose: str) -> np.ndarray:
    """An input_image part's image (HxWx3 uint8 RGB): `count`-th of `whose` images."""
    info, settings = session.server.info, session.server.settings
    if not info.takes("image"):
        takes = " and ".join(("text",) + (info.media or ()))
        raise RealtimeEventError(f"{where}.type: pipeline {session.model!r} takes no images (its model reads "
                                 f"{takes}): input_image parts are refused", f"{where}.type", "unsupported_value",
                                 eid)
    param = f"{where}.image_url"
    if not c.image_url:
        raise RealtimeEventError(f"{param}: an input_image part needs its image (a data: URL, "
                                 "data:image/png;base64,...)", param, "missing_required_parameter", eid)
    if count > settings.max_media_items:
        raise RealtimeEventError(f"{param}: {whose} would hold {count} images, more than the server's limit of "
                                 f"{settings.max_media_items} (--max-media-items); delete items that hold images",
                                 param, "too_many_images", eid)
    try:
        return await asyncio.to_thread(_decode, c.image_url, param, settings.max_media_bytes)
    except ApiError as e:  # the data URL or its bytes (400), or an image past --max-media-mb (413)
        raise RealtimeEventError(e.message, e.param or param, "image_too_large" if e.status == 413 else
                                 e.code or "invalid_value", eid) from None


def _decode(url: str, param: str, max_bytes: int) -> np.ndarray:
    _, data = parse_data_url(url, param, "image")
    return decode_image(data, param, max_bytes)


async def response_context(entries: list[dict[str, Any]], eid: str | None, session: Session) -> Conversation:
    """A response's own `input`: its items, or references to the conversation's, in order."""
    context = Conversation()
    for i, raw in enumerate(entries):
        at = f"response.input[{i}]"
        if raw.get("type") == "item_reference":
            ref = raw.get("id")
            item = session.conversation.find(ref) if isinstance(ref, str) else None
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
        context.items.append(await client_item(it, at, eid, session, context))
    return context
