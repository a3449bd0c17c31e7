"""The thinkers' encoder cache: encoder outputs of media items, LRU, keyed by the item's content hash.

A request whose image straddles a prefix-cached block and a fresh one, or a conversation that re-sends its
earlier clips every turn, re-runs no encoder (the vLLM encoder-cache idea). The engine's prefix cache keeps
KV blocks, not encoder outputs: this cache lives with the model that owns the encoders.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from omni.engine.memory import StageGeometry

DEFAULT_ENTRIES = 128  # model_kwargs.encoder_cache_size


class EncoderCache:
    """At most `size` entries (an item's encoder rows, or whatever the thinker keeps per item), least recently
    used evicted first; counts its misses (`runs`: the encoder ran) and `hits`."""

    def __init__(self, size: int = DEFAULT_ENTRIES):
        self.size = int(size)
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self.runs = 0
        self.hits = 0

    def get(self, key: str) -> Any | None:
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return hit

    def put(self, key: str, value: Any) -> None:
        """An encoder output just computed (one run)."""
        self.runs += 1
        self._entries[key] = value
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        return {"encoder_runs": self.runs, "encoder_cache_hits": self.hits, "encoder_cache_entries": len(self)}

    @staticmethod
    def bytes_at_fullest(model_kwargs: dict[str, Any], geometry: StageGeometry, dtype_bytes: int,
                         item_rows: int) -> int:
        """`encoder_cache_size` entries (as a thinker's `load` reads it), each one media item's encoder output of
        at most `item_rows` rows of hidden_size in the stage's dtype: what the planner reserves for it."""
        return int(model_kwargs.get("encoder_cache_size", DEFAULT_ENTRIES)) * item_rows * geometry.hidden_size \
            * dtype_bytes
