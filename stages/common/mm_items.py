"""A prompt's media items: each image / audio / video input preprocessed once (MMItem), content-hashed, and placed in
the prompt's token ids (one placeholder run per item), for every omni family's thinker.

A video with its audio track (`use_audio_in_video`) is one item: its run holds the video's and the track's
placeholders interleaved by time, between the audio bos/eos tokens (`ids`, as the omni processors write it).

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

    modality: str  # "image" | "audio" | "video"
    mm_hash: str
    num_tokens: int  # encoder rows = placeholder tokens in the prompt
    # image / video: pixel values [patches, C*T*P*P] + grid_thw [3]; audio: features [mel, frames], or None until
    # read
    _data: torch.Tensor | None
    grid_thw: torch.Tensor | None = None
    offset: int = -1  # first placeholder token in the prompt, set by expand_placeholders
    frames: int = 0  # audio: valid mel frames
    _make: Callable[[], torch.Tensor] | None = None  # audio: makes the features (a picklable partial)
    second_per_grid: float = 0.0  # video: seconds per temporal patch (transformers' video_second_per_grid)
    audio: MMItem | None = None  # video with use_audio_in_video: its audio track
    # What replaces the item's placeholder token: None, `num_tokens` copies of it; else these ids, the encoder rows
    # at [lead, lead + num_tokens) of them (a video with its track: audio bos, video and audio pads, audio eos)
    ids: list[int] | None = None
    lead: int = 0

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            self._data, self._make = self._make(), None
        return self._data


def mm_hash(inp: MultiModalInput, extra: str = "") -> str:
    """The input's content hash (its modality, dtype, shape, rate and bytes; `extra`: what else sets the item's
    encoder rows, e.g. a video's audio track)."""
    data = np.ascontiguousarray(np.asarray(inp.data))
    h = xxhash.xxh3_128()
    head = f"{inp.modality}|{data.dtype.str}|{data.shape}|{inp.sampling_rate}|"
    if inp.modality == "video":
        head += f"{inp.fps}|{extra}|"
    h.update(head.encode())
    h.update(memoryview(data).cast("B"))
    return h.hexdigest()


def content_text(content: Any, where: str, model: str, placeholders: dict[str, str]) -> str:
    """A chat message's content as the omni chat templates write it: text parts joined, a media part (image, audio,
    video) as its placeholder in `placeholders` (the thinker then repeats the pad once per encoder row); None (an
    assistant turn of tool calls only) is empty."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return str(content)
    text = ""
    for j, item in enumerate(content):
        kind = item.get("type", "text")
        if kind in placeholders:
            text += placeholders[kind]
        elif kind == "text":
            text += item.get("text", "")
        else:
            raise RequestError(f"{where}.content[{j}].type: the {model} thinker takes text, "
                               f"{', '.join(placeholders)} (got {kind!r})", field=f"{where}.content[{j}].type")
    return text


def expand_placeholders(ids: list[int], items: list[MMItem], pads: dict[str, int]) -> list[int]:
    """Replace the k-th placeholder id of each modality (`pads`: modality -> its pad id) by the k-th item of that
    modality's tokens (`num_tokens` pads, or its `ids`).

    Items are matched per modality, in order (as transformers' processor does); sets their offsets."""
    kinds = {pad: kind for kind, pad in pads.items()}
    queues = {kind: [i for i in items if i.modality == kind] for kind in pads}
    used = dict.fromkeys(pads, 0)
    out: list[int] = []
    for t in ids:
        kind = kinds.get(t)
        if kind is None:
            out.append(t)
            continue
        k = used[kind]
        if k >= len(queues[kind]):
            raise RequestError(f"prompt: more {kind} placeholders than {kind} mm_inputs ({len(queues[kind])})",
                               field="prompt")
        item = queues[kind][k]
        item.offset = len(out) + item.lead
        out.extend([t] * item.num_tokens if item.ids is None else item.ids)
        used[kind] = k + 1
    for kind, queue in queues.items():
        if used[kind] != len(queue):
            raise RequestError(f"prompt: {len(queue)} {kind} mm_inputs but {used[kind]} {kind} placeholders",
                               field="prompt")
    return out
