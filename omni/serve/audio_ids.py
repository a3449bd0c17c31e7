"""The transcripts of this server's recent audio replies, by audio id (OpenAI's multi-turn voice pattern).

A spoken chat reply carries `audio.id` and `audio.expires_at`; OpenAI's clients continue the conversation
with an assistant message `{"role": "assistant", "audio": {"id": ...}}` until then, and the server puts
that reply back into the prompt. What the omni thinkers take for an earlier assistant turn is its text,
so the server keeps each reply's transcript (text, not audio: a few hundred bytes) until its
`expires_at`, at most `max_entries` of them (the oldest leave first). An id this server does not know
(expired, evicted, or minted by another server process) is a 400 naming the message's `audio.id`: the
client can send the transcript as the message's content instead.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict


class AudioTranscripts:
    def __init__(self, ttl_s: float, max_entries: int = 10_000, clock=time.time):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expires_at, transcript)

    def put(self, audio_id: str, transcript: str, expires_at: float) -> None:
        with self._lock:
            self._items[audio_id] = (expires_at, transcript)
            self._items.move_to_end(audio_id)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def get(self, audio_id: str) -> str | None:
        """The transcript of a reply's audio, or None once it expired or when it is unknown here."""
        with self._lock:
            item = self._items.get(audio_id)
            if item is None:
                return None
            if item[0] <= self._clock():
                del self._items[audio_id]
                return None
            return item[1]

    def __len__(self) -> int:
        return len(self._items)
