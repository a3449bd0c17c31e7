"""Streaming edges, as one stage worker sees them: chunks out of an upstream request, chunks into
a downstream one.

    upstream worker (thinker)                          downstream worker (talker)
    engine deltas ──> Outgoing ──chunk(seq 0)──┐       Incoming: waits for chunk 0 (timeout)
                                 chunk(seq 1)──┼──>    chunk 0 -> processor chunk form -> add_request(input_complete=False)
    finished output ─> last chunk(finished) ───┘       chunk k -> extend_request(..., last=chunk.finished)

A chunk is a StageDelta: the upstream tokens generated since the previous chunk and, when the
downstream processor reads rows, the rows of the tokens computed since then, so that over all
chunks the downstream prompt is exactly what the non-streaming edge would have built. Chunks
carry a sequence number; a downstream applies them in order and merges those that wait (a slow
stage holds at most one merged chunk per request, never a growing queue).

Every wait for a chunk has a deadline (runtime.stream_chunk_timeout_s): it finds a producer that died
or lost the request, not one that is busy. The deadline counts from the downstream's submission and
restarts with every chunk and every ALIVE signal (no data, no sequence number of its own). The
upstream sends ALIVE to each consumer when it admits the request into its engine, and again whenever
it has sent that consumer nothing for a third of the timeout while it still holds the request:
queued behind other requests, waiting for its own upstream's chunks, or prefilling a long prompt. So
under load a chain of streamed stages (llm ~> tts ~> codec) waits as long as each stage still has
the request; the codec's clock never runs through the llm's queue, prefill and first sentence.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from omni.messages import StageDelta, StageOutput
from omni.pipeline.backend import StreamTarget, Submission


ALIVE = -1  # the sequence number of the signal "the upstream holds the request" (see the module docstring)


@dataclass(slots=True)
class _TargetProgress:
    target: StreamTarget
    tokens_sent: int = 0
    text_sent: int = 0
    rows_sent: int = 0
    seq: int = 0
    last_sent: float = field(default_factory=time.monotonic)  # its last chunk or ALIVE signal


class Outgoing:
    """One upstream request's chunks for its streaming consumers."""

    def __init__(self, stage: str, request_id: str, targets: list[StreamTarget]):
        self.stage = stage
        self.request_id = request_id
        self.progress = [_TargetProgress(t) for t in targets]
        self.tokens: list[int] = []  # generated so far
        self.text = ""  # their text so far (a consumer that reads the reply's words: a TTS speaking an LLM's reply)
        self.prompt_ids: list[int] | None = None  # from the first delta; sent with every first chunk

    @property
    def needs_rows(self) -> bool:
        return any(p.target.needs_rows for p in self.progress)

    def alive(self, every_s: float | None = None) -> list[tuple[StreamTarget, int, StageDelta]]:
        """The ALIVE signal (this stage still holds the request: their clocks restart) for every consumer, or with
        `every_s` for those sent nothing for that long."""
        now = time.monotonic()
        due = [p for p in self.progress if every_s is None or now - p.last_sent >= every_s]
        for p in due:
            p.last_sent = now
        return [(p.target, ALIVE, StageDelta(self.request_id, self.stage)) for p in due]

    def alive_due(self, every_s: float) -> float:
        """When (monotonic) a consumer is next due an ALIVE signal, if nothing is sent to it before."""
        return min((p.last_sent for p in self.progress), default=float("inf")) + every_s

    def on_delta(self, delta: StageDelta, read_rows: Callable[[int, int], dict[str, np.ndarray]]
                 ) -> list[tuple[StreamTarget, int, StageDelta]]:
        """Chunks due after one step of the running request: (target, seq, chunk)."""
        self.tokens.extend(delta.token_ids)
        self.text += delta.text
        if delta.prompt_token_ids is not None:
            self.prompt_ids = delta.prompt_token_ids
        if delta.finished:
            return []  # the finished output carries the rest (on_finished)
        out = []
        for p in self.progress:
            avail = delta.num_computed_tokens - p.rows_sent if p.target.needs_rows else len(self.tokens) - p.tokens_sent
            if avail >= p.target.chunk_tokens:
                rows = read_rows(p.rows_sent, delta.num_computed_tokens) if p.target.needs_rows else {}
                out.append(self._emit(p, self.tokens[p.tokens_sent:], rows, delta.num_computed_tokens, False))
        return out

    def on_finished(self, full: StageOutput) -> list[tuple[StreamTarget, int, StageDelta]]:
        """The last chunk of every consumer, from the request's complete output."""
        self.prompt_ids = list(full.prompt_token_ids)
        if full.text is not None:
            self.text = full.text
        out = []
        for p in self.progress:
            rows: dict[str, np.ndarray] = {}
            end = p.rows_sent
            if p.target.needs_rows:
                per_token = dict(full.mm_outputs)
                if full.hidden_states is not None:
                    per_token["hidden_states"] = full.hidden_states
                end = max((v.shape[0] for v in per_token.values()), default=p.rows_sent)
                rows = {k: v[p.rows_sent:] for k, v in per_token.items()}
            out.append(self._emit(p, list(full.token_ids[p.tokens_sent:]), rows, end, True))
        return out

    def _emit(self, p: _TargetProgress, tokens: list[int], rows: dict[str, np.ndarray], rows_end: int,
              finished: bool) -> tuple[StreamTarget, int, StageDelta]:
        chunk = StageDelta(self.request_id, self.stage, token_ids=list(tokens), text=self.text[p.text_sent:],
                           finished=finished,
                           num_computed_tokens=rows_end, rows=rows, rows_start=p.rows_sent,
                           prompt_token_ids=self.prompt_ids if p.seq == 0 else None)
        p.tokens_sent += len(tokens)
        p.text_sent = len(self.text)
        p.rows_sent = rows_end if p.target.needs_rows else p.rows_sent
        p.seq += 1
        p.last_sent = time.monotonic()
        return p.target, p.seq - 1, chunk


def merge_chunks(a: StageDelta, b: StageDelta) -> StageDelta:
    """Two consecutive chunks of one request as one (b follows a)."""
    rows = {k: np.concatenate([a.rows[k], b.rows[k]]) if k in a.rows else b.rows[k] for k in b.rows}
    for k in a.rows:
        rows.setdefault(k, a.rows[k])
    audio = b.audio
    if a.audio is not None:
        audio = a.audio if b.audio is None else np.concatenate([a.audio, b.audio])
    return StageDelta(a.request_id, a.stage, token_ids=a.token_ids + b.token_ids, text=a.text + b.text,
                      num_prompt_tokens=b.num_prompt_tokens, num_computed_tokens=b.num_computed_tokens,
                      finished=b.finished, rows=rows, rows_start=a.rows_start,
                      prompt_token_ids=a.prompt_token_ids if a.prompt_token_ids is not None else b.prompt_token_ids,
                      audio=audio, sampling_rate=b.sampling_rate or a.sampling_rate,
                      logprobs=_joined(a.logprobs, b.logprobs),
                      prompt_text=_first(a.prompt_text, b.prompt_text),
                      prompt_token_texts=_first(a.prompt_token_texts, b.prompt_token_texts),
                      prompt_logprobs=_first(a.prompt_logprobs, b.prompt_logprobs),
                      num_cached_tokens=_first(a.num_cached_tokens, b.num_cached_tokens),
                      prompt_mm_tokens=_first(a.prompt_mm_tokens, b.prompt_mm_tokens),
                      cached_mm_tokens=_first(a.cached_mm_tokens, b.cached_mm_tokens))


def _joined(a: list | None, b: list | None) -> list | None:
    return a if b is None else b if a is None else a + b


def _first(a: Any, b: Any) -> Any:
    return a if a is not None else b


@dataclass(slots=True)
class Incoming:
    """One downstream request fed over a streaming edge, until its last chunk is applied."""

    sub: Submission  # its stream_from names the upstream stage
    timeout_s: float
    deadline: float
    state: Any = None  # the chunk processor's typed state, across chunks (registry: chunk_state)
    next_seq: int = 0
    waiting: dict[int, StageDelta] = field(default_factory=dict)  # arrived early (seq > next_seq)
    ready: StageDelta | None = None  # in order, merged, not yet applied
    started: bool = False  # admitted into the engine

    @property
    def upstream(self) -> str:
        assert self.sub.stream_from is not None
        return self.sub.stream_from

    def receive(self, seq: int, chunk: StageDelta) -> None:
        if seq == ALIVE:  # the upstream still holds the request: its next chunk is due from now
            self.deadline = time.monotonic() + self.timeout_s
            return
        if seq < self.next_seq:
            return  # a duplicate
        self.waiting[seq] = chunk
        while self.next_seq in self.waiting:
            c = self.waiting.pop(self.next_seq)
            self.ready = c if self.ready is None else merge_chunks(self.ready, c)
            self.next_seq += 1
        self.deadline = time.monotonic() + self.timeout_s

    def take(self) -> StageDelta | None:
        chunk, self.ready = self.ready, None
        return chunk

    def expired(self, now: float) -> bool:
        return self.ready is None and now >= self.deadline

    def timeout_error(self, stage: str) -> str:
        what = "the next chunk" if self.started else "the first chunk"
        return (f"stage {stage!r}: {what} on the streaming edge {self.upstream} -> {stage} did not arrive "
                f"within {self.timeout_s:g}s (runtime.stream_chunk_timeout_s; {self.next_seq} chunk(s) received)")
