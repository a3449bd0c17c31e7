"""Orchestrator: routes each request through the stage graph.

    add_request ──> entry stages
    stage S finished request R ──> for each downstream D of S:
        all of D's inputs finished R?  ──> submit R to D with {input: output handle}
    every stage finished R ──> RequestOutput(outputs of the final stages)

Streaming edges S ~> D: D is submitted together with S (`stream_from=S`); S hands D
its output chunk by chunk while it runs, stage to stage (the backend carries the
chunks: in-process, or actor to actor on Ray); the orchestrator only sees both finish.
A caller that streams also gets every stage's deltas (tokens, text) as they happen.

The orchestrator never looks inside intermediate outputs: a backend hands it
an opaque *handle* per (stage, request) (the StageOutput itself in-process, an
ObjectRef on Ray) plus a small *summary* (error, text, tokens; heavy arrays
only for final stages). The downstream stage's worker applies its input
processor to the upstream outputs where it runs (stage_worker.py), so tensors
go stage-to-stage directly.

Request ids are unique among the requests in flight: checked here (and by each
stage's scheduler); a finished or aborted id may be reused.

A backend implements:

    submit(stage, request, upstream: dict[str, handle] | None, sampling, keep_hidden,
           stream_to=(StreamTarget...), stream_from=None | stage, stream_out=False) -> None
    poll(timeout_s) -> list[StageEvent]     # stages that finished a request (or streamed a delta)
    abort(stage, request_id) -> None
    stats() -> dict[str, dict]              # per stage
    close() -> None
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni.outputs import RequestOutput, StageDelta, StageInput, StageOutput, error_output
from omni.pipeline.graph import StageGraph
from omni.pipeline.streaming import StreamTarget, merge_chunks

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StageEvent:
    """A stage finished (or failed) a request, or reported a delta of a streamed one."""

    stage: str
    request_id: str
    summary: StageOutput | None  # error set when the stage failed the request; None for a delta
    handle: Any = None  # what downstream stages get (backend-specific)
    delta: StageDelta | None = None


class Backend(Protocol):
    def submit(self, stage: str, request: StageInput, upstream: dict[str, Any] | None,
               sampling: Any, keep_hidden: bool, *, stream_to: tuple[StreamTarget, ...] = (),
               stream_from: str | None = None, stream_out: bool = False) -> None: ...
    def poll(self, timeout_s: float) -> list[StageEvent]: ...
    def abort(self, stage: str, request_id: str) -> None: ...
    def stats(self) -> dict[str, dict[str, Any]]: ...
    def close(self) -> None: ...


# ------------------------------------------------------------ orchestrator
@dataclass(slots=True)
class _Req:
    request: StageInput
    sampling: dict[str, Any]
    keep_hidden: bool
    timeout_s: float
    deadline: float
    stream: bool
    handles: dict[str, Any] = field(default_factory=dict)  # finished stage -> handle, until consumed
    submitted: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)
    outputs: dict[str, StageOutput] = field(default_factory=dict)


class Orchestrator:
    """Backend-independent request routing. Thread-safe; `step()` does the work."""

    def __init__(self, graph: StageGraph, backend: Backend, request_timeout_s: float = 600.0):
        self.graph = graph
        self.backend = backend
        self.request_timeout_s = request_timeout_s
        self._lock = threading.RLock()
        self._reqs: dict[str, _Req] = {}
        self._results: dict[str, RequestOutput] = {}
        self._events: dict[str, list[StageOutput]] = {}  # streamed final-stage outputs
        self._counts = {"total": 0, "finished": 0, "failed": 0, "aborted": 0, "timed_out": 0}
        self._stage_counts = {n: {"submitted": 0, "completed": 0, "errors": 0} for n in graph.order}

    # ------------------------------------------------------------ requests
    def add_request(self, request: StageInput, sampling: Mapping[str, Any] | None = None, *,
                    return_hidden_states: bool = False, stream: bool = False,
                    timeout_s: float | None = None) -> str:
        """Start `request` on every entry stage. `sampling`: stage -> params (None: stage defaults)."""
        rid = request.request_id
        with self._lock:
            if rid in self._reqs or rid in self._results:
                raise ValueError(f"request_id {rid!r} is already in use")
            timeout_s = timeout_s or self.request_timeout_s
            st = _Req(request, dict(sampling or {}), return_hidden_states, timeout_s,
                      time.monotonic() + timeout_s, stream)
            self._reqs[rid] = st
            self._counts["total"] += 1
            if stream:
                self._events[rid] = []
            for stage in self.graph.entry_stages:
                if not self._submit(st, stage, None):
                    break
        return rid

    def _submit(self, st: _Req, stage: str, upstream: dict[str, Any] | None) -> bool:
        """Hand the request to `stage` (and to the stages it streams into); False when that failed
        (the request is then failed)."""
        g = self.graph
        targets = tuple(StreamTarget(d, edge.chunk_tokens, g.needs_rows(d)) for d, edge in g.streams_to(stage))
        st.submitted.add(stage)
        self._stage_counts[stage]["submitted"] += 1
        try:
            self.backend.submit(stage, st.request, upstream, st.sampling.get(stage), st.keep_hidden,
                                stream_to=targets, stream_from=g.streams_from(stage), stream_out=st.stream)
        except Exception as e:  # noqa: BLE001 - e.g. the backend lost its connection
            logger.exception("submitting request %s to stage %s failed", st.request.request_id, stage)
            st.finished.add(stage)
            self._fail(st.request.request_id, st, stage,
                       f"stage {stage!r} failed: could not submit the request: {type(e).__name__}: {e}")
            return False
        # A streaming consumer starts with its producer, waiting for the first chunk.
        return all(self._submit(st, t.stage, None) for t in targets)

    def abort(self, request_id: str) -> bool:
        """Abort on every stage; the request finishes with an "aborted" error. False if unknown."""
        with self._lock:
            st = self._reqs.get(request_id)
            if st is None:
                return False
            self._fail(request_id, st, None, f"request {request_id!r} was aborted", kind="abort")
            return True

    def _fail(self, rid: str, st: _Req, stage: str | None, error: str, kind: str = "error") -> None:
        """Finish `rid` with `error` (kind: error | abort | timeout) and abort it where it still runs."""
        if stage is not None and kind == "error":
            cut = [d for d, _ in self.graph.streams_to(stage) if d in st.submitted and d not in st.finished]
            if cut:  # say which streaming edges lost their producer mid-stream
                error += "; its streaming edge(s) " + ", ".join(f"{stage} -> {d}" for d in cut) + " were cut off"
        for s in st.submitted - st.finished:
            if s != stage:
                self.backend.abort(s, rid)
        del self._reqs[rid]
        self._counts[{"error": "failed", "abort": "aborted", "timeout": "timed_out"}[kind]] += 1
        reason = "abort" if kind == "abort" else "error"
        self._results[rid] = RequestOutput(rid, _prompt_of(st.request), dict(st.outputs),
                                           finished=True, error=error)
        if st.stream:
            pending = sorted(st.submitted - st.finished, key=self.graph.order.index)
            self._events[rid].append(error_output(stage or (pending[0] if pending else ""), rid, error, reason))

    # ----------------------------------------------------------------- work
    def step(self, timeout_s: float = 0.05) -> None:
        """Wait up to `timeout_s` for stage events, route them, and expire overdue requests."""
        events = self.backend.poll(timeout_s)
        with self._lock:
            for ev in events:
                self._on_event(ev)
            self._expire()

    def _on_event(self, ev: StageEvent) -> None:
        st = self._reqs.get(ev.request_id)
        if st is None or ev.stage not in st.submitted or ev.stage in st.finished:
            return  # aborted, failed or timed out meanwhile
        if ev.delta is not None:
            if st.stream:
                self._push_event(ev.request_id, ev.delta)
            return
        st.finished.add(ev.stage)
        counts = self._stage_counts[ev.stage]
        counts["completed"] += 1
        out = ev.summary
        if out.error is not None or out.finish_reason == "abort":
            counts["errors"] += 1
            err = out.error or "aborted by the stage"
            self._fail(ev.request_id, st, ev.stage, f"stage {ev.stage!r} failed: {err}")
            return
        if self.graph.is_final(ev.stage):
            st.outputs[ev.stage] = out
            if st.stream:
                self._push_event(ev.request_id, out)
        st.handles[ev.stage] = ev.handle
        for d in self.graph.downstream[ev.stage]:
            ups = self.graph.upstream[d]
            if d not in st.submitted and all(u in st.finished for u in ups):
                if not self._submit(st, d, {u: st.handles[u] for u in ups}):
                    return
        # Drop handles nobody will consume any more (frees objects in Ray's store).
        for s in list(st.handles):
            if all(d in st.submitted for d in self.graph.downstream[s]):
                del st.handles[s]
        if len(st.finished) == len(self.graph.order):
            del self._reqs[ev.request_id]
            self._counts["finished"] += 1
            outputs = {n: st.outputs[n] for n in self.graph.final_stages}
            self._results[ev.request_id] = RequestOutput(ev.request_id, _prompt_of(st.request), outputs)

    def _push_event(self, rid: str, item: StageDelta | StageOutput) -> None:
        """Queue an item for the caller. Deltas of one stage that the caller has not taken yet are
        merged: a slow consumer holds at most one pending delta per stage, not a growing list."""
        events = self._events[rid]
        if isinstance(item, StageDelta):
            for i in range(len(events) - 1, -1, -1):
                prev = events[i]
                if isinstance(prev, StageDelta) and prev.stage == item.stage:
                    events[i] = merge_chunks(prev, item)  # per stage the order is kept
                    return
        events.append(item)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, st in list(self._reqs.items()):
            if now >= st.deadline:
                pending = sorted(st.submitted - st.finished, key=self.graph.order.index)
                self._fail(rid, st, None,
                           f"request {rid!r} timed out after {st.timeout_s:g}s "
                           f"(runtime.request_timeout_s) waiting for stage(s) {', '.join(pending) or '-'}",
                           kind="timeout")

    # -------------------------------------------------------------- results
    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._reqs)

    def is_known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._reqs or request_id in self._results

    def is_done(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._results

    def pop_result(self, request_id: str) -> RequestOutput | None:
        with self._lock:
            out = self._results.pop(request_id, None)
            if out is not None:
                self._events.pop(request_id, None)
            return out

    def pop_events(self, request_id: str) -> list[StageDelta | StageOutput]:
        with self._lock:
            evs = self._events.get(request_id)
            if not evs:
                return []
            self._events[request_id] = []
            return evs

    def stats(self) -> dict[str, Any]:
        with self._lock:
            in_flight = {n: 0 for n in self.graph.order}
            for st in self._reqs.values():
                for s in st.submitted - st.finished:
                    in_flight[s] += 1
            return {
                "requests": {**self._counts, "in_flight": len(self._reqs)},
                "stages": {n: {**self._stage_counts[n], "in_flight": in_flight[n]} for n in self.graph.order},
            }


def _prompt_of(request: StageInput) -> Any:
    if request.prompt is not None:
        return request.prompt
    return request.prompt_token_ids
