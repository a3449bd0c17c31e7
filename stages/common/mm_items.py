"""A prompt's media items: each image / audio input preprocessed once (MMItem), content-hashed, and placed in the
prompt's token ids (one placeholder run per item), for every omni family's thinker.

Every input is content-hashed (xxhash of its bytes): the hash keys the encoder cache and the KV-block extra keys,
so prompts that differ only in an image never share a block.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from omni.errors import RequestError
from omni.messages import MultiModalInput


@dataclass(slots=True)
class MMItem:
    """One preprocessed multimodal input of a prompt.

    An audio clip's log-mel features are made when the encoder first reads them (`data`), not when the
    prompt is prepared: a clip whose rows the encoder cache holds, or whose tokens the prefix cache already
    covers, never needs them, and a conversation re-sends every earlier clip each turn (Whisper's features
    of a clip padded to 30 s cost ~7.5 ms whatever its length). What the prompt needs, its token count and
    frame count, comes from the clip's length; the clip was checked when the item was made."""

    modality: str  # "image" | "audio"
    mm_hash: str
    num_tokens: int  # placeholder tokens in the prompt
    # image: pixel_values [patches, C*T*P*P] + grid_thw [3]; audio: features [mel, frames], or None until read
    _data: torch.Tensor | None
    grid_thw: torch.Tensor | None = None
    offset: int = -1  # first placeholder token in the prompt, set by expand_placeholders
    frames: int = 0  # audio: valid mel frames (one per hop started)
    _make: Callable[[], torch.Tensor] | None = None  # audio: makes the features (a picklable partial)

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            self._data, self._make = self._make(), None
        return self._data


def mm_hash(inp: MultiModalInput) -> str:
    data = np.ascontiguousarray(np.asarray(inp.data))
    h = xxhash.xxh3_128()
    h.update(f"{inp.modality}|{data.dtype.str}|{data.shape}|{inp.sampling_rate}|".encode())
    h.update(memoryview(data).cast("B"))
    return h.hexdigest()


def content_text(content: Any, where: str, model: str, image_placeholder: str, audio_placeholder: str) -> str:
    """A chat message's content as the omni chat templates write it: text parts joined, an image or audio part as
    its placeholder (the thinker then repeats the pad once per encoder row); None (an assistant turn of tool
    calls only) is empty."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return str(content)
    text = ""
    for j, item in enumerate(content):
        kind = item.get("type", "text")
        if kind == "image":
            text += image_placeholder
        elif kind == "audio":
            text += audio_placeholder
        elif kind == "text":
            text += item.get("text", "")
        else:
            raise RequestError(f"{where}.content[{j}].type: the {model} thinker takes text, image and audio (got "
                               f"{kind!r}; video inputs are not supported yet)", field=f"{where}.content[{j}].type")
    return text


def expand_placeholders(ids: list[int], items: list[MMItem], image_id: int, audio_id: int) -> list[int]:
    """Replace the k-th image (audio) placeholder id by the k-th image (audio) item's token count.

    Items are matched per modality, in order (as transformers' processor does); sets their offsets."""
    queues = {image_id: [i for i in items if i.modality == "image"],
              audio_id: [i for i in items if i.modality == "audio"]}
    used = {image_id: 0, audio_id: 0}
    out: list[int] = []
    for t in ids:
        if t in queues:
            k = used[t]
            if k >= len(queues[t]):
                kind = "image" if t == image_id else "audio"
                raise RequestError(f"prompt: more {kind} placeholders than {kind} mm_inputs ({len(queues[t])})",
                                   field="prompt")
            item = queues[t][k]
            item.offset = len(out)
            out.extend([t] * item.num_tokens)
            used[t] = k + 1
        else:
            out.append(t)
    for t, kind in ((image_id, "image"), (audio_id, "audio")):
        if used[t] != len(queues[t]):
            raise RequestError(f"prompt: {len(queues[t])} {kind} mm_inputs but {used[t]} {kind} placeholders",
                               field="prompt")
    return out
