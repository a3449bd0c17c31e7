"""Orchestrator: routes each request through the stage graph.

    add_request ──> entry stages
    stage S finished request R ──> for each downstream D of S that R needs:
        all of D's inputs finished R?  ──> submit R to D with {input: output handle}
    every stage R needs finished R ──> RequestOutput(outputs of the final stages)

What a request needs: the final stages of its `output_modalities` (all by default) and every
stage upstream of them (graph.stages_for): a text-only reply of thinker -> talker -> vocoder
runs the thinker alone.

Streaming edges S ~> D: D is submitted together with S (`stream_from=S`); S hands D
its output chunk by chunk while it runs, stage to stage (the backend carries the
chunks: in-process, or actor to actor on Ray); the orchestrator only sees both finish.
A caller that streams also gets every stage's deltas (tokens, text) as they happen.

The orchestrator never looks inside intermediate outputs: a backend hands it
an opaque *handle* per (stage, request) (the StageOutput itself in-process, an
ObjectRef on Ray) plus a small *summary* (error, text, tokens; heavy arrays
only for final stages). The downstream stage's worker applies its input
processor to the upstream outputs where it runs (stage_worker.py), so tensors
go stage-to-stage directly. What it does read of a summary, the number of tokens the stage
generated, rides on the outputs of the final stages fed by it (StageOutput.upstream_tokens:
a talker's codec tokens on its vocoder's output, usage's audio tokens).

Request ids are unique among the requests in flight: checked here (and by each
stage's scheduler); a finished or aborted id may be reused.

Replicas: a stage may run as several replicas (`replicas: N`); every submission picks
one through the stage's router (routing/), and a streaming consumer's
replica is picked together with its producer's, which then pushes its chunks to that
replica. A replica that dies with requests in flight reports them `replica_lost`: each is
sent once more to another replica (router.on_replica_failure: retry) or fails with the
replica's error; a request is answered once either way (events from a replica it moved
away from are dropped).

The backend seam (the Backend protocol, Submission, StageEvent) is backend.py.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni.errors import (BackendClosedError, OmniError, RequestAbortedError, RequestError, RequestTimeoutError,
                         StageError, as_omni_error)
from omni.messages import RequestOutput, StageDelta, StageInput, StageOutput, error_output
from omni.pipeline.backend import Backend, StageEvent, StreamTarget, Submission
from omni.pipeline.graph import StageGraph
from omni.pipeline.routing.table import Lineage, PipelineRouting
from omni.pipeline.streaming import merge_chunks

logger = logging.getLogger(__name__)


# ------------------------------------------------------------ orchestrator
# How a request that ends early counts in stats()' requests, by the kind of its end (_fail).
_OUTCOME = {"error": "failed", "abort": "aborted", "timeout": "timed_out", "complete": "finished"}


@dataclass(slots=True)
class _Req:
    request: StageInput
    sampling: dict[str, Any]
    keep_hidden: bool
    timeout_s: float
    deadline: float
    stream: bool
    lineage: Lineage
    handles: dict[str, Any] = field(default_factory=dict)  # finished stage -> handle, until consumed
    submitted: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)
    outputs: dict[str, StageOutput] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)  # upstream handles of a stage that may be retried
    retried: set[str] = field(default_factory=set)  # stages it was sent to a second replica of
    streamed: set[str] = field(default_factory=set)  # stages whose deltas reached the caller
    generated: dict[str, int] = field(default_factory=dict)  # finished stage -> the tokens it generated
    held: list[str] = field(default_factory=list)  # final stages whose outputs wait for their inputs' counts
    # The stages this request runs (graph.stages_for its output_modalities): a text-only reply never
    # reaches the audio stages, so nothing of theirs can fail it.
    needed: frozenset[str] = frozenset()


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
        self._closed = False
        self._stage_counts = {n: {"submitted": 0, "completed": 0, "errors": 0, "retried": 0} for n in graph.order}
        self.routing = PipelineRouting(graph)
        self.routing.load_tokenizer()  # now, not under the lock of the first request

    # ------------------------------------------------------------ requests
    def add_request(self, request: StageInput, sampling: Mapping[str, Any] | None = None, *,
                    return_hidden_states: bool = False, stream: bool = False,
                    timeout_s: float | None = None, output_modalities: Collection[str] | None = None) -> str:
        """Start `request` on every entry stage it needs. `sampling`: stage -> params (None: stage defaults).
        `output_modalities`: the final outputs wanted (None: all); only the stages they need run."""
        rid = request.request_id
        needed = self.graph.stages_for(output_modalities)
        with self._lock:
            if self._closed:
                raise BackendClosedError("this pipeline is closed", request_id=rid)
            if rid in self._reqs or rid in self._results:
                raise RequestError(f"request_id {rid!r} is already in use", field="request_id",
                                   code="duplicate_request_id", request_id=rid)
            timeout_s = timeout_s or self.request_timeout_s
            st = _Req(request, dict(sampling or {}), return_hidden_states, timeout_s,
                      time.monotonic() + timeout_s, stream, self.routing.lineage(request), needed=needed)
            self._reqs[rid] = st
            self._counts["total"] += 1
            if stream:
                self._events[rid] = []
            for stage in self.graph.entry_stages:
                if stage in needed and not self._submit(st, stage, None):
                    break
        return rid

    def _submit(self, st: _Req, stage: str, upstream: dict[str, Any] | None, replica: int | None = None,
                exclude: tuple[int, ...] = ()) -> bool:
        """Hand the request to `stage` (`replica`, else the router's choice) and to the stages it streams
        into (their replicas chosen now: the producer pushes its chunks to them); False when that failed
        (the request is then failed)."""
        g = self.graph
        if replica is None:
            replica = self._place(st, stage, exclude)
        targets = tuple(StreamTarget(d, edge.chunk_tokens, g.needs_rows(d), self._place(st, d))
                        for d, edge in g.streams_to(stage) if d in st.needed)
        st.submitted.add(stage)
        self._stage_counts[stage]["submitted"] += 1
        try:
            self.backend.submit(Submission(
                stage, st.request, upstream, sampling=st.sampling.get(stage), keep_hidden=st.keep_hidden,
                replica=replica, stream_to=targets, stream_from=g.streams_from(stage), stream_out=st.stream))
        except Exception as e:  # noqa: BLE001 - e.g. the backend lost its connection
            logger.exception("submitting request %s to stage %s failed", st.request.request_id, stage)
            st.finished.add(stage)
            self._fail(st.request.request_id, st, stage, StageError(
                f"stage {stage!r} failed: could not submit the request: {type(e).__name__}: {e}", stage=stage))
            return False
        if self._retryable(stage):
            st.inputs[stage] = upstream  # kept until the stage finishes: a retry needs them again
        # A streaming consumer starts with its producer, waiting for the first chunk.
        return all(self._submit(st, t.stage, None, t.replica) for t in targets)

    # ------------------------------------------------------------ replicas
    def _states(self, stage: str) -> list[str]:
        states = getattr(self.backend, "replica_states", None)
        return list(states(stage)) if states is not None else ["up"] * self.graph.stages[stage].replicas

    def _place(self, st: _Req, stage: str, exclude: tuple[int, ...] = ()) -> int:
        states = self._states(stage)
        avoid = set(exclude) | {i for i, s in enumerate(states) if s == "dead"}
        if len(avoid) >= len(states):  # all dead: the backend answers with the stage's error
            avoid = set(exclude) if len(exclude) < len(states) else set()
        return self.routing.place(st.lineage, stage, [s == "up" for s in states], tuple(sorted(avoid)))

    def _retryable(self, stage: str) -> bool:
        s = self.graph.stages[stage]
        return s.replicas > 1 and s.router.on_replica_failure == "retry"

    def _retry(self, st: _Req, ev: StageEvent) -> bool:
        """Send a request that a dying replica lost to another replica, once; False (with the reason added
        to the event's error) when it is not retried."""
        stage, rid = ev.stage, ev.request_id
        if self.graph.stages[stage].replicas < 2:
            return False
        others = [i for i, s in enumerate(self._states(stage)) if s != "dead" and i != ev.replica]
        why = None
        if self.graph.stages[stage].router.on_replica_failure != "retry":
            why = "router.on_replica_failure is 'fail'"
        elif stage in st.retried:
            why = "it was retried once already"
        elif self.graph.streams_to(stage) or self.graph.streams_from(stage):
            why = "the stage is on a streaming edge"
        elif stage in st.streamed:
            why = "part of its output already went to the caller"
        elif not others:
            why = "no other replica is left"
        if why is not None:
            err = as_omni_error(ev.summary.error or "the replica was lost", stage)
            ev.summary.error = err.replace(f"{err.message} (not retried: {why})")
            return False
        logger.warning("stage %s replica %d lost request %s; retrying it on another replica: %s",
                       stage, ev.replica, rid, ev.summary.error)
        self.backend.abort(stage, rid, replica=ev.replica)  # unreachable is not always dead
        self.routing.released(st.lineage, stage)
        st.retried.add(stage)
        st.submitted.discard(stage)
        self._stage_counts[stage]["retried"] += 1
        self._stage_counts[stage]["submitted"] -= 1  # counted again by _submit
        self._submit(st, stage, st.inputs.get(stage), exclude=(ev.replica,))
        return True

    def abort(self, request_id: str, *, complete: bool = False) -> bool:
        """Abort on every stage; the request finishes with an "aborted" error. False if unknown.

        `complete`: the caller already has all it asked for (a text-only reply whose text is whole: the audio
        stages it did not want are stopped), so the request counts as finished, not aborted."""
        with self._lock:
            st = self._reqs.get(request_id)
            if st is None:
                return False
            self._fail(request_id, st, None, RequestAbortedError(f"request {request_id!r} was aborted",
                                                                 request_id=request_id),
                       kind="complete" if complete else "abort")
            return True

    def close(self) -> None:
        """Fail every request in flight with BackendClosedError (counted aborted) and refuse new ones: the
        backend is closing, and nothing it ran would ever answer them (a caller would wait for its timeout).
        Idempotent. Their stages are not aborted one by one: closing the backend releases them all."""
        with self._lock:
            self._closed = True
            for rid, st in list(self._reqs.items()):
                self._fail(rid, st, None, BackendClosedError(
                    f"the pipeline was closed while request {rid!r} was running", request_id=rid),
                           kind="abort", abort_stages=False)

    def _fail(self, rid: str, st: _Req, stage: str | None, error: OmniError, kind: str = "error",
              abort_stages: bool = True) -> None:
        """Finish `rid` with `error` (kind: error | abort | timeout | complete: see abort) and abort it where it
        still runs (unless not `abort_stages`)."""
        if stage is not None and kind == "error":
            cut = [d for d, _ in self.graph.streams_to(stage) if d in st.submitted and d not in st.finished]
            if cut:  # say which streaming edges lost their producer mid-stream
                error = error.replace(error.message + "; its streaming edge(s) "
                                      + ", ".join(f"{stage} -> {d}" for d in cut) + " were cut off")
        if error.request_id is None:
            error = error.replace(request_id=rid)
        for s in st.submitted - st.finished if abort_stages else ():
            if s != stage:
                self.backend.abort(s, rid, replica=self.routing.replica_of(st.lineage, s))
        for s in list(st.lineage.placed):
            self.routing.released(st.lineage, s)
        st.inputs.clear()
        del self._reqs[rid]
        self._counts[_OUTCOME[kind]] += 1
        reason = "abort" if kind in ("abort", "complete") else "error"
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
        out = ev.summary
        if out is not None and out.cache_report is not None:  # the replica's, whatever became of the request
            self.routing.cache_report(ev.stage, ev.replica, out.cache_report)
            out.cache_report = None
        if ev.replica_lost:
            self.routing.replica_lost(ev.stage, ev.replica)
        st = self._reqs.get(ev.request_id)
        if st is None or ev.stage not in st.submitted or ev.stage in st.finished:
            return  # aborted, failed or timed out meanwhile
        placed = st.lineage.placed.get(ev.stage)
        if placed is not None and placed.replica != ev.replica:
            return  # from a replica the request moved away from
        if ev.delta is not None:
            st.streamed.add(ev.stage)
            if st.stream:
                self._push_event(ev.request_id, ev.delta)
            return
        if ev.replica_lost and self._retry(st, ev):
            return
        st.finished.add(ev.stage)
        self.routing.finished(st.lineage, ev.stage, out)
        self.routing.released(st.lineage, ev.stage)
        st.inputs.pop(ev.stage, None)
        counts = self._stage_counts[ev.stage]
        counts["completed"] += 1
        if out.error is not None or out.finish_reason == "abort":
            counts["errors"] += 1
            # The stage's typed error as it came (its stage, field, code and numbers), the message saying where.
            err = as_omni_error(out.error or RequestAbortedError("aborted by the stage"), ev.stage)
            self._fail(ev.request_id, st, ev.stage,
                       err.replace(f"stage {ev.stage!r} failed: {err.message}", stage=err.stage or ev.stage))
            return
        st.generated[ev.stage] = len(out.token_ids)
        if self.graph.is_final(ev.stage):  # (of the stages it runs)
            st.outputs[ev.stage] = out
            st.held.append(ev.stage)
        self._release_finals(ev.request_id, st)
        st.handles[ev.stage] = ev.handle
        for d in self.graph.downstream[ev.stage]:
            ups = self.graph.upstream[d]
            if d in st.needed and d not in st.submitted and all(u in st.finished for u in ups):
                if not self._submit(st, d, {u: st.handles[u] for u in ups}):
                    return
        # Drop handles nobody will consume any more (frees objects in Ray's store).
        for s in list(st.handles):
            if all(d in st.submitted or d not in st.needed for d in self.graph.downstream[s]):
                del st.handles[s]
        if st.needed <= st.finished:
            del self._reqs[ev.request_id]
            self._counts["finished"] += 1
            outputs = {n: st.outputs[n] for n in self.graph.final_stages if n in st.needed}
            self._results[ev.request_id] = RequestOutput(ev.request_id, _prompt_of(st.request), outputs)

    def _release_finals(self, rid: str, st: _Req) -> None:
        """Final outputs whose input stages have all finished get their `upstream_tokens` (how the talker's codec
        token count reaches the caller: the talker is no final stage) and go to a streaming caller. One waits here
        while an input has not: on Ray a consumer on a streaming edge may be polled finished before its producer
        (two actors, no order between their events), and its output must not leave without that count."""
        for stage in list(st.held):
            inputs = self.graph.upstream[stage]
            if not all(u in st.finished for u in inputs):
                continue
            st.held.remove(stage)
            out = st.outputs[stage]
            out.upstream_tokens = {u: st.generated.get(u, 0) for u in inputs}
            if st.stream:
                self._push_event(rid, out)

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
                self._fail(rid, st, None, RequestTimeoutError(
                    f"request {rid!r} timed out after {st.timeout_s:g}s "
                    f"(runtime.request_timeout_s) waiting for stage(s) {', '.join(pending) or '-'}",
                    stage=pending[0] if pending else None, limit=st.timeout_s), kind="timeout")

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
                "routers": {n: self.routing.stats(n) for n in self.graph.order if self.graph.stages[n].replicas > 1},
            }


def _prompt_of(request: StageInput) -> Any:
    if request.prompt is not None:
        return request.prompt
    return request.prompt_token_ids
