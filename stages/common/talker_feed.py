"""The streaming upstream->talker chunk machine, and the payloads a thinker hands a talker (both families).

A talker's prompt needs the thinker's prompt rows and the row of its first reply token g0, which exists once g1
is sampled: over a streaming edge the thinker's chunks are collected (`TalkerFeed`, the chunk processor's typed
state) until then, the whole prompt is built at once (a family's `ThinkerReply` subclass, with `streaming` set
while more follows), and every later chunk only hands on its new tokens and their rows (`ReplyRows`, through the
engine's `extend_request`). A thinker that finishes before that fails the request: a reply of fewer than two
tokens cannot be voiced (REPLY_TOO_SHORT_TO_VOICE; `omni serve` then voices the text whole).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from omni.errors import REPLY_TOO_SHORT_TO_VOICE, RequestError
from omni.messages import EdgePayload, StageDelta


@dataclass(slots=True, kw_only=True)
class ThinkerReply(EdgePayload):
    """What a talker's prompt is built from: the thinker's prompt and reply (families add the thinker's rows)."""

    prompt_ids: list[int]
    output_ids: list[int]
    speaker: str | None = None  # the caller's voice (None: the talker's default)
    streaming: bool = False  # more of the reply follows, as ReplyRows chunks


@dataclass(slots=True)
class ReplyRows(EdgePayload):
    """A later chunk of a streamed reply: its new tokens and the thinker rows computed since the last chunk."""

    output_ids: list[int]
    rows: np.ndarray  # [n, width] float32 (n may be 0)


class Fed(enum.Enum):
    WAIT = "wait"  # the talker's prompt cannot be built yet
    START = "start"  # it can, now: build it from the collected rows
    MORE = "more"  # it was built: this chunk extends the reply


@dataclass(slots=True)
class TalkerFeed:
    """A thinker->talker chunk processor's state across one request's chunks."""

    prompt: list[int] | None = None  # the thinker's prompt (its first chunk carries it)
    gen: list[int] = field(default_factory=list)  # reply tokens so far
    rows: dict[str, list[np.ndarray]] = field(default_factory=dict)  # row pieces until the talker starts
    num_rows: int = 0  # thinker rows received
    started: bool = False

    def add(self, chunk: StageDelta, edge: str, upstream: str, needed: tuple[str, ...],
            optional: tuple[str, ...] = ()) -> Fed:
        """Take one chunk whose rows must hold `needed` (and may hold `optional`); ValueError naming `edge` when
        they are missing or out of order, RequestError when the thinker finished with a reply too short."""
        if chunk.prompt_token_ids is not None:
            self.prompt = list(chunk.prompt_token_ids)
        rows = chunk.rows or {}
        if rows and any(name not in rows for name in needed):
            raise ValueError(f"{edge}: the thinker chunk carries no {' / '.join(needed)} rows "
                             f"(is the upstream a {upstream} stage?)")
        if rows and chunk.rows_start != self.num_rows:
            raise ValueError(f"{edge}: thinker rows from {chunk.rows_start}, expected {self.num_rows} "
                             "(a chunk was lost)")
        self.num_rows += len(rows[needed[0]]) if rows else 0
        self.gen.extend(chunk.token_ids)
        if self.started:
            return Fed.MORE
        for name in needed + optional:
            if name in rows:
                self.rows.setdefault(name, []).append(np.asarray(rows[name], dtype=np.float32))
        if self.prompt is None or len(self.gen) < 2 or self.num_rows < len(self.prompt) + 1:
            if chunk.finished:
                n = len(self.gen)
                if n < 2:
                    raise RequestError(f"{edge}: the talker needs >= 2 thinker tokens (the thinker finished with "
                                       f"{n})", code=REPLY_TOO_SHORT_TO_VOICE, actual=n, limit=2)
                raise ValueError(f"{edge}: the talker needs >= 2 thinker tokens and their rows (the thinker "
                                 f"finished with {n} tokens)")
            return Fed.WAIT
        self.started = True
        return Fed.START

    def joined(self, name: str) -> np.ndarray | None:
        """The collected rows of `name`, in order (None: none came)."""
        pieces = self.rows.get(name)
        return np.concatenate(pieces) if pieces else None


def reply_rows(chunk: StageDelta, name: str) -> ReplyRows:
    """A later chunk's new tokens and its `name` rows (none: an empty array)."""
    rows = (chunk.rows or {}).get(name)
    return ReplyRows(list(chunk.token_ids), np.zeros((0, 0), np.float32) if rows is None else rows)
