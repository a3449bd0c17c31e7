"""One Realtime session's conversation: its items, and the prompt each turn sends the pipeline.

Every turn's prompt is the whole conversation so far, rendered the same way every time (instructions as
the system turn, each item in order, input audio as the very same 16 kHz arrays): turn N's prompt starts
with turn N-1's, token for token and audio for audio, so the thinker's prefix cache (and the talker's,
fed with the thinker's cached rows) holds everything but the new turn.

    user items       text parts, input audio (pcm16 at 24 kHz, resampled once to the model's rate) and
                     input images (decoded once: the same RGB arrays every turn, so the encoder cache hits too)
    assistant items  the reply's text (its transcript when the reply was audio): what the model said,
                     as the chat template expects a previous assistant turn
    system items     system turns where they stand
    function calls   the model's calls, in the assistant turn they follow (as the model wrote them: text,
                     then <tool_call> blocks), or an assistant turn of their own
    call outputs     tool results (the `tool` role: the chat template writes them as <tool_response>s)

An assistant reply that was interrupted keeps the text that had been sent with the audio the user heard
(`truncate`), so the next turn does not pretend the user heard the rest.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni.messages import MultiModalInput
from omni.serve.audio.codecs import clips


def _arguments(text: str) -> Any:
    """A call's arguments as chat templates read them: the JSON object (the text itself if it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def new_item_id() -> str:
    return f"item_{uuid.uuid4().hex[:24]}"


@dataclass
class Part:
    kind: str  # input_text | input_audio | input_image | output_text | output_audio | text
    text: str = ""  # text, or the transcript of output audio
    audio: np.ndarray | None = None  # input audio at the model's rate
    image: np.ndarray | None = None  # an input image: HxWx3 uint8 RGB
    detail: str = "auto"  # an input image's `detail` (accepted; the model's own resolution rules apply)
    audio_rate: int = 16000
    transcript: str | None = None  # input audio: its transcription, once done (realtime/transcription.py)

    @property
    def nbytes(self) -> int:
        """What it holds in memory, about (a character a byte): what the session's conversation bound counts."""
        media = sum(a.nbytes for a in (self.audio, self.image) if a is not None)
        return len(self.text) + len(self.transcript or "") + media


@dataclass
class ConvItem:
    id: str
    role: str
    parts: list[Part]
    status: str = "completed"
    # Output audio: (audio ms sent so far, transcript chars sent by then), one entry per audio delta.
    timeline: list[tuple[float, int]] = field(default_factory=list)
    type: str = "message"  # | function_call (call_id, name, arguments) | function_call_output (call_id, output)
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    output: str = ""

    def shape(self) -> dict[str, Any]:
        """The item as events carry it (input audio and images are not echoed back: the client has them; an
        image part shows its type and detail only)."""
        base = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "function_call":
            return {**base, "call_id": self.call_id, "name": self.name, "arguments": self.arguments}
        if self.type == "function_call_output":
            return {**base, "call_id": self.call_id, "output": self.output}
        content = []
        for p in self.parts:
            if p.kind == "input_audio":
                content.append({"type": "input_audio", "transcript": p.transcript})
            elif p.kind == "input_image":
                content.append({"type": "input_image", "detail": p.detail})
            elif p.kind == "output_audio":
                content.append({"type": "output_audio", "transcript": p.text})
            else:
                content.append({"type": p.kind, "text": p.text})
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": self.role, "content": content}

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if p.kind != "input_audio")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) + len(self.arguments) + len(self.output)

    @property
    def images(self) -> int:
        return sum(p.kind == "input_image" for p in self.parts)

    def truncate_at(self, audio_end_ms: float) -> None:
        """Keep the transcript sent with the first `audio_end_ms` of the reply's audio."""
        chars = 0
        for ms, n in self.timeline:
            if ms > audio_end_ms:
                break
            chars = n
        for p in self.parts:
            if p.kind in ("output_audio", "output_text"):
                p.text = p.text[:chars]
        self.status = "incomplete"

    @property
    def audio_ms(self) -> float:
        return self.timeline[-1][0] if self.timeline else 0.0


class Conversation:
    def __init__(self) -> None:
        self.items: list[ConvItem] = []
        # Items left out of the model's context by truncation ("auto": the conversation outgrew the thinker's
        # max_model_len); they stay in the conversation (retrieve, delete), and stay out of every later prompt,
        # so that the prompts keep one prefix for the caches.
        self.dropped: set[str] = set()

    def drop_oldest(self, count: int, writing: ConvItem | None = None) -> int:
        """Leave the `count` oldest items in the context out of it, then any that would start the context with
        something but a user message (a reply or a call's output without its question); the newest item always
        stays. `writing`: the item the response in progress writes (not in its own prompt: never counted as the
        newest). Returns how many were dropped (0: nothing left to drop)."""
        kept = [i for i in self.items if i.id not in self.dropped and i is not writing]
        if len(kept) <= 1:
            return 0
        n = min(count, len(kept) - 1)
        while n < len(kept) - 1 and not (kept[n].type == "message" and kept[n].role == "user"):
            n += 1
        self.dropped.update(i.id for i in kept[:n])
        return n

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    def find(self, item_id: str) -> ConvItem | None:
        return next((i for i in self.items if i.id == item_id), None)

    def add(self, item: ConvItem, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` (None: at the end; "root": first); returns the id before it."""
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            prev = self.find(previous_item_id)
            if prev is None:
                raise KeyError(previous_item_id)
            at = self.items.index(prev) + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at > 0 else None

    def delete(self, item_id: str) -> bool:
        item = self.find(item_id)
        if item is None:
            return False
        self.items.remove(item)
        self.dropped.discard(item_id)
        return True

    def last_user(self) -> ConvItem | None:
        """The newest user message the prompts hold (a voice agent's new turn, when it holds audio)."""
        return next((i for i in reversed(self.items) if i.id not in self.dropped and i.type == "message"
                     and i.role == "user"), None)

    def prompt(self, instructions: str | None, cascade: bool = False
               ) -> tuple[list[dict[str, Any]], list[MultiModalInput]]:
        """Chat messages (media as {"type": "audio" | "image"} parts, as chat completions' prompts) and their
        audio and images, in order. `cascade`: a voice agent's (ASR -> LLM -> TTS): the newest user turn's audio
        goes as one clip each part (its recognizer hears the last whole), every earlier user turn's audio as its
        transcript (realtime/cascade.py)."""
        messages: list[dict[str, Any]] = []
        media: list[MultiModalInput] = []
        if instructions:
            messages.append({"role": "system", "content": instructions})
        last = self.last_user() if cascade else None
        for item in self.items:
            if item.id in self.dropped:
                continue
            if item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": _arguments(item.arguments)}}
                if messages and messages[-1]["role"] == "assistant":  # the reply's text, then its calls
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                continue
            if item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
                continue
            if item.role != "user":
                text = item.text
                if item.role == "assistant" and not text:
                    continue  # an assistant turn that said nothing heard (cut before its first word)
                messages.append({"role": item.role, "content": text})
                continue
            if cascade and item is not last:
                if turn := _heard_turn(item):
                    messages.append({"role": "user", "content": turn})
                continue
            parts: list[dict[str, Any]] = []
            for p in item.parts:
                if p.kind == "input_audio" and p.audio is not None:
                    # a turn longer than the encoder's window is heard as consecutive clips of it (a recognizer
                    # hears the whole)
                    for clip in [p.audio] if cascade else clips(p.audio, p.audio_rate):
                        parts.append({"type": "audio"})
                        media.append(MultiModalInput("audio", clip, sampling_rate=p.audio_rate))
                elif p.kind == "input_image" and p.image is not None:
                    parts.append({"type": "image"})
                    media.append(MultiModalInput("image", p.image))
                elif p.text:
                    parts.append({"type": "text", "text": p.text})
            if parts:
                messages.append({"role": "user", "content": parts})
        return messages, media


def _heard_turn(item: ConvItem) -> str | list[dict[str, Any]] | None:
    """An earlier user turn as a voice agent's LLM read it (stages/qwen3_asr/edges.py `with_transcript`): its
    text parts, then its audio's transcript (the transcript alone when it holds nothing else); None: nothing (audio
    never transcribed: its turn was cancelled before, and its transcription failed)."""
    kept = [{"type": "text", "text": p.text} for p in item.parts if p.kind == "input_text" and p.text]
    known = [p.transcript for p in item.parts if p.kind == "input_audio" and p.transcript is not None]
    if not known:
        return kept or None
    heard = " ".join(known)
    return [*kept, {"type": "text", "text": heard}] if kept else heard
