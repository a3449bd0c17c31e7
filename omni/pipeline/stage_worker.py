"""StageWorker: one stage's engine + input processor + in-flight bookkeeping (both backends).

The local backend runs one worker per stage in-process; the Ray backend runs one in
each stage actor. The worker is where an edge's input processor runs: on the
downstream side, on the upstream outputs it was handed.

    submit(Submission)/abort()/push_chunk()
                      only queue (thread-safe: the Ray actor calls them from its event loop)
    tick()            applies the queue to the engine, runs one engine step -> TickResult:
                      the requests that finished [(full output, summary for the driver)], the
                      chunks due on streaming edges, and the caller's deltas

Streaming edges (streaming.py): a submission with `stream_from` waits here (not in the
engine) for its first chunk, then grows chunk by chunk; one submitted with `stream_to` yields
chunks for its consumers as it runs. Chunks that come before their submission are kept for it
(on Ray they come actor to actor, the submission from the driver: nothing orders the two).

Engine calls happen in tick() alone, so one thread at a time touches the engine. A
request is in flight here from its add until the engine step that finishes it (its id
in the step's finished_req_ids) or until it is aborted; nothing else releases it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from omni import registry
from omni.config.schema import StageConfig
from omni.engine.interface import Engine
from omni.errors import OmniError, StageError
from omni.messages import CacheReport, StageDelta, StageInput, StageOutput, error_output
from omni.pipeline.backend import StreamTarget, Submission
from omni.pipeline.step_timers import StepTimers
from omni.pipeline.streaming import Incoming, Outgoing

TEXT_OPS = ("tokenize", "detokenize")  # what StageWorker.text runs on the engine
logger = logging.getLogger(__name__)


# ------------------------------------------------------------ edge helpers
def passthrough_tokens(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Default input processor: the upstream generated token ids (concatenated, in `inputs` order)."""
    ids: list[int] = []
    for out in upstream.values():
        ids.extend(out.token_ids)
    return StageInput(request.request_id, prompt_token_ids=ids, cache_salt=request.cache_salt)


def passthrough_tokens_chunk(chunk: StageDelta, request: StageInput, state: object) -> StageInput:
    """passthrough_tokens on a streaming edge: the tokens generated since the last chunk."""
    return StageInput(request.request_id, prompt_token_ids=list(chunk.token_ids), cache_salt=request.cache_salt)


def build_stage_input(processor: Any, request: StageInput, upstream: dict[str, StageOutput] | None,
                      sampling: Any) -> StageInput:
    """The StageInput a stage receives: the user's input (entry stage) or the processed upstream outputs."""
    if upstream is None:
        inp = dataclasses.replace(request)
    else:
        inp = (processor or passthrough_tokens)(upstream, request)
        if not isinstance(inp, StageInput):
            raise OmniError(f"input processor {getattr(processor, '__name__', processor)!r} returned "
                            f"{type(inp).__name__}, expected a StageInput")
        inp.request_id = request.request_id
    if sampling is not None:
        inp.sampling_params = sampling
    return inp


def summarize(out: StageOutput, final_output: str | None, keep_hidden: bool) -> StageOutput:
    """What the driver needs of a stage output: for an intermediate stage only the small fields; for a
    final stage everything except the per-token rows (hidden states, mm_outputs), which are kept only
    when asked for or when they are the final output."""
    if final_output is None:
        return dataclasses.replace(out, hidden_states=None, mm_outputs={}, passthrough={}, audio=None)
    if keep_hidden or final_output == "hidden" or (out.hidden_states is None and not out.mm_outputs):
        return out
    return dataclasses.replace(out, hidden_states=None, mm_outputs={})


def _admission_error(e: Exception, stage: str, rid: str) -> OmniError:
    """Why a stage refused a request, typed: an OmniError it raised on purpose keeps its type (a RequestError is
    the caller's to fix: the engine's request checks raise those, naming the field), with the stage and request id
    filled in; anything else, a bare ValueError included (a stage model's own shape check, a bug), is the stage's:
    a StageError, its traceback logged by the caller."""
    if isinstance(e, OmniError):
        return e.replace(stage=e.stage or stage, request_id=e.request_id or rid)
    return StageError(f"could not admit the request: {type(e).__name__}: {e}", stage=stage, request_id=rid)


# ------------------------------------------------------------------ worker
@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Chunk:
    """A chunk of a streamed input, `seq`-th from its upstream stage."""

    request_id: str
    seq: int
    chunk: StageDelta


@dataclass(slots=True)
class TickResult:
    finished: list[tuple[StageOutput, StageOutput]] = field(default_factory=list)  # (full, summary)
    chunks: list[tuple[StreamTarget, str, int, StageDelta]] = field(default_factory=list)  # (to, rid, seq, chunk)
    deltas: list[StageDelta] = field(default_factory=list)  # for callers that stream


class StageWorker:
    """One stage's engine + input processor + in-flight bookkeeping."""

    def __init__(self, stage: StageConfig, engine: Engine, *, emit_hidden_states: bool = True,
                 chunk_timeout_s: float = 60.0):
        """`emit_hidden_states`: every request hands its per-token rows out (a downstream stage reads
        them, see StageGraph.emits_hidden_states); otherwise only requests whose caller asks.
        `chunk_timeout_s`: longest wait for a chunk on a streaming input."""
        self.stage = stage
        self.name = stage.name
        self.engine = engine
        self.info = engine.info()  # read once: the backend hands it to the driver (Backend.infos)
        self.emit_hidden_states = emit_hidden_states
        self.processor = registry.resolve_input_processor(stage.input_processor) if stage.input_processor else None
        self._inbox: deque[Submission | _Abort | _Chunk] = deque()
        self._in_flight: dict[str, bool] = {}  # request id -> the caller wants its rows back
        self._ready: list[tuple[StageOutput, StageOutput]] = []
        self.chunk_timeout_s = chunk_timeout_s
        self._chunk_fn, self._chunk_state = (
            registry.resolve_incremental_processor(stage.input_processor or "passthrough_tokens")
            if any(e.stream for e in stage.input_edges) else (None, None))
        self._incoming: dict[str, Incoming] = {}  # waiting for (more) chunks
        self._alive: list[tuple[StreamTarget, str, int, StageDelta]] = []  # ALIVE signals not sent yet
        # Chunks whose request's submission has not reached this worker yet -> (expiry, chunks in arrival order).
        self._early: dict[str, tuple[float, list[_Chunk]]] = {}
        self._outgoing: dict[str, Outgoing] = {}  # feeding streaming consumers
        self.timers = StepTimers()  # tick_s here; a Ray actor adds its own hand-off costs (step_timers.py)
        self._stream_out: set[str] = set()  # the caller wants deltas
        self._rows_sent: dict[str, int] = {}  # rows already attached to a caller's deltas

    def submit(self, sub: Submission) -> None:
        """Queue a request; its `upstream` holds the upstream stages' StageOutputs themselves."""
        self._inbox.append(sub)

    def abort(self, request_id: str) -> None:
        self._inbox.append(_Abort(request_id))

    def push_chunk(self, request_id: str, seq: int, chunk: StageDelta) -> None:
        self._inbox.append(_Chunk(request_id, seq, chunk))

    def has_work(self) -> bool:
        now = time.monotonic()
        return (bool(self._inbox) or bool(self._ready) or self.engine.has_unfinished()
                or any(inc.expired(now) for inc in self._incoming.values())
                or any(out.alive_due(self._alive_every_s) <= now for out in self._outgoing.values()))

    def next_deadline(self) -> float | None:
        """When a chunk wait runs out, or a consumer is due an ALIVE signal, next (monotonic), or None: the
        step loop wakes up then."""
        return min([inc.deadline for inc in self._incoming.values()]
                   + [out.alive_due(self._alive_every_s) for out in self._outgoing.values()], default=None)

    @property
    def _alive_every_s(self) -> float:
        """A held request's consumers hear from it at least this often (a third of their chunk timeout)."""
        return self.chunk_timeout_s / 3

    def _done(self, out: StageOutput, keep_hidden: bool) -> None:
        self._ready.append((out, summarize(out, self.stage.final_output, keep_hidden)))

    def _fail(self, rid: str, error: OmniError | str) -> None:
        """Fail `rid` here with a typed error (a text is this stage's account of what broke: a StageError)."""
        self._done(error_output(self.name, rid, error), False)

    def drain(self) -> None:
        touched: set[str] = set()
        now = time.monotonic()
        for rid in [r for r, (expiry, _) in self._early.items() if expiry < now]:
            del self._early[rid]  # an aborted or failed request's late chunks: its submission never comes
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, _Abort):
                # No output: whoever aborts has already finished the request on its side.
                rid = item.request_id
                self._incoming.pop(rid, None)
                self._early.pop(rid, None)
                self._drop_streams(rid)
                if self._in_flight.pop(rid, None) is not None:
                    self.engine.abort(rid)
                continue
            if isinstance(item, _Chunk):
                inc = self._incoming.get(item.request_id)
                if inc is not None:
                    inc.receive(item.seq, item.chunk)
                    touched.add(item.request_id)
                elif item.request_id not in self._in_flight:
                    # Its submission has not come yet: on Ray the producer pushes its chunks actor to actor
                    # while the submission comes from the driver, and nothing orders the two. Kept until it
                    # comes (or for the chunk timeout: an aborted request's late chunks).
                    self._early.setdefault(item.request_id, (now + self.chunk_timeout_s, []))[1].append(item)
                continue  # else: a request that no longer waits for chunks here (failed meanwhile)
            sub = item
            rid = sub.request_id
            if sub.stream_out:
                self._stream_out.add(rid)
            if sub.stream_to:
                self._outgoing[rid] = Outgoing(self.name, rid, list(sub.stream_to))
            if sub.stream_from is not None:
                inc = self._incoming[rid] = Incoming(sub, self.chunk_timeout_s, time.monotonic() + self.chunk_timeout_s,
                                                     self._chunk_state())
                self._in_flight[rid] = sub.keep_hidden
                for early in self._early.pop(rid, (0.0, []))[1]:
                    inc.receive(early.seq, early.chunk)
                    touched.add(rid)
                continue
            try:
                inp = build_stage_input(self.processor, sub.request, sub.upstream, sub.sampling)
            except Exception as e:  # noqa: BLE001 - a bad request must not take the stage down
                logger.exception("stage %s: input processor failed for %s", self.name, rid)
                self._fail(rid, f"input processor {self.stage.input_processor or 'passthrough_tokens'!r} "
                                f"failed: {type(e).__name__}: {e}")
                continue
            self._admit(rid, inp, sub.keep_hidden)
        for rid in touched:
            self._apply_chunks(rid)

    def _admit(self, rid: str, inp: StageInput, keep_hidden: bool) -> bool:
        out = self._outgoing.get(rid)
        inp.return_hidden_states = keep_hidden or self.emit_hidden_states or bool(out and out.needs_rows)
        inp.stream = rid in self._stream_out or out is not None
        try:
            self.engine.add_request(inp)
            if out is not None:  # its consumers' first-chunk clocks restart now (streaming.ALIVE)
                self._alive += [(to, rid, seq, c) for to, seq, c in out.alive()]
        except Exception as e:  # noqa: BLE001 - a refused request fails alone
            if not isinstance(e, OmniError):  # not a refusal on purpose: the stage's fault, its traceback kept
                logger.exception("stage %s: admitting %s failed", self.name, rid)
            self._drop_streams(rid)
            self._fail(rid, _admission_error(e, self.name, rid))
            return False
        self._in_flight[rid] = keep_hidden
        return True

    def _apply_chunks(self, rid: str) -> None:
        """Hand a streamed request's chunks that arrived in order to the engine."""
        inc = self._incoming.get(rid)
        chunk = inc.take() if inc is not None else None
        if chunk is None:
            return
        name = self.stage.input_processor or "passthrough_tokens"
        try:
            part = self._chunk_fn(chunk, inc.sub.request, inc.state)
        except Exception as e:  # noqa: BLE001
            logger.exception("stage %s: input processor failed on a chunk of %s", self.name, rid)
            why = f"input processor {name!r} failed on a chunk from stage {inc.upstream!r}: "
            # a typed refusal keeps its type and code (a reply the talker cannot voice: the server voices it whole)
            self._stream_failed(rid, inc, e.replace(why + e.message, stage=e.stage or self.name, request_id=rid)
                                if isinstance(e, OmniError) else why + f"{type(e).__name__}: {e}")
            return
        if part is None and not inc.started:
            if chunk.finished:  # the processor's chunk form must raise instead; guard anyway
                self._stream_failed(rid, inc, f"input processor {name!r} built no input from stage "
                                              f"{inc.upstream!r}'s complete output")
            return  # it needs more of the upstream's output before the request can start
        if chunk.finished:
            del self._incoming[rid]
        if not inc.started:
            inp = build_stage_input(None, part, None, inc.sub.sampling)
            # An upstream that finished before this stage looked hands its whole output in one piece. A
            # stage that cuts a streamed input into pieces of work (token2wav's windows) still gets it as
            # a growing input, ended at once: whether its audio streams in pieces, and the waveform's last
            # bits, must not follow the actors' timing. An autoregressive stage computes the same tokens
            # either way, so it takes the whole input as one prompt.
            growing = not chunk.finished or getattr(self.engine, "cuts_streamed_input", False)
            inp.input_complete = not growing
            inc.started = True
            del self._in_flight[rid]
            if self._admit(rid, inp, inc.sub.keep_hidden) and growing and chunk.finished:
                self._extend(rid, inc, StageInput(rid), last=True)
            return
        self._extend(rid, inc, part if part is not None else StageInput(rid), last=chunk.finished)

    def _extend(self, rid: str, inc: Incoming, part: StageInput, last: bool) -> None:
        try:
            self.engine.extend_request(rid, list(part.prompt_token_ids or []), part.prompt_embeds,
                                       last=last, payload=part.payload)
        except Exception as e:  # noqa: BLE001
            self._stream_failed(rid, inc, f"a chunk from stage {inc.upstream!r} was refused: {type(e).__name__}: {e}")

    def _stream_failed(self, rid: str, inc: Incoming, error: OmniError | str) -> None:
        self._incoming.pop(rid, None)
        if inc.started:
            self.engine.abort(rid)
        self._in_flight.pop(rid, None)
        self._drop_streams(rid)
        self._fail(rid, error)

    def _drop_streams(self, rid: str) -> None:
        self._outgoing.pop(rid, None)
        self._stream_out.discard(rid)
        self._rows_sent.pop(rid, None)

    def tick(self) -> TickResult:
        """Apply queued adds/aborts/chunks, run one engine step; return what came of it."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._tick()
        finally:
            self.timers.ticks += 1
            self.timers.tick_s += time.perf_counter() - t0
            self.timers.tick_cpu_s += time.thread_time() - c0

    def _tick(self) -> TickResult:
        self.drain()
        now = time.monotonic()
        for rid, out in self._outgoing.items():  # held here, nothing sent lately: the consumers wait on
            if out.alive_due(self._alive_every_s) <= now:
                self._alive += [(to, rid, seq, c) for to, seq, c in out.alive(self._alive_every_s)]
        result = TickResult(chunks=self._alive)
        self._alive = []
        for rid, inc in list(self._incoming.items()):
            if inc.expired(now):
                self._stream_failed(rid, inc, inc.timeout_error(self.name))
        if self.engine.has_unfinished():
            try:
                step = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail what is in flight, keep serving
                logger.exception("stage %s: engine step failed", self.name)
                for rid in list(self._in_flight):
                    del self._in_flight[rid]
                    self._incoming.pop(rid, None)
                    self._drop_streams(rid)
                    try:
                        self.engine.abort(rid)
                    except Exception:  # noqa: BLE001
                        logger.exception("stage %s: abort of %s failed", self.name, rid)
                    self._fail(rid, f"engine step failed: {type(e).__name__}: {e}")
            else:
                self._streamed(step.deltas, {o.request_id: o for o in step.finished}, result)
                # step.aborted reports our own aborts: those entries are gone already.
                for out in step.finished:
                    keep = self._in_flight.pop(out.request_id, None)
                    if keep is not None:
                        outgoing = self._outgoing.pop(out.request_id, None)
                        if outgoing is not None and out.ok:
                            result.chunks += [(to, out.request_id, seq, c) for to, seq, c in outgoing.on_finished(out)]
                        self._drop_streams(out.request_id)
                        self._done(out, keep)
        result.finished, self._ready = self._ready, []
        if result.finished:
            self._attach_cache_report(result.finished[-1][1])
        return result

    def _attach_cache_report(self, summary: StageOutput) -> None:
        """The prefix cache's evictions since the last report ride on a summary to the driver's router."""
        take = getattr(self.engine, "take_evicted_blocks", None)  # optional in the engine contract
        if take is None:
            return
        evicted, overflow = take()
        if evicted or overflow:
            summary.cache_report = CacheReport(evicted, overflow)

    def _streamed(self, deltas: list[StageDelta], finished: dict[str, StageOutput], result: TickResult) -> None:
        for d in deltas:
            rid = d.request_id
            if rid in self._stream_out:
                if self._in_flight.get(rid):  # the caller asked for the rows too: the new ones ride along
                    self._attach_rows(d, finished.get(rid))
                result.deltas.append(d)
            outgoing = self._outgoing.get(rid)
            if outgoing is None:
                continue
            try:
                due = outgoing.on_delta(d, lambda a, b, rid=rid: self.engine.read_rows(rid, a, b))
            except Exception as e:  # noqa: BLE001 - e.g. rows that cannot be read: fail this request only
                logger.exception("stage %s: streaming %s failed", self.name, rid)
                self._in_flight.pop(rid, None)
                self._drop_streams(rid)
                self.engine.abort(rid)
                self._fail(rid, f"streaming its output failed: {type(e).__name__}: {e}")
                continue
            result.chunks += [(to, rid, seq, c) for to, seq, c in due]

    def _attach_rows(self, d: StageDelta, out: StageOutput | None) -> None:
        start = self._rows_sent.get(d.request_id, 0)
        if out is not None:  # the step that finished it: the rest comes from its complete output
            per_token = dict(out.mm_outputs)
            if out.hidden_states is not None:
                per_token["hidden_states"] = out.hidden_states
            d.rows = {k: v[start:] for k, v in per_token.items()}
            self._rows_sent.pop(d.request_id, None)
        elif d.num_computed_tokens > start:
            d.rows = self.engine.read_rows(d.request_id, start, d.num_computed_tokens)
            self._rows_sent[d.request_id] = d.num_computed_tokens
        d.rows_start = start

    def text(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """vLLM's /tokenize or /detokenize (`op`) on this stage's engine: its tokenizer and prompt renderer."""
        if op not in TEXT_OPS:
            raise ValueError(f"text op {op!r}: one of {TEXT_OPS}")
        return getattr(self.engine, op)(*args, **kwargs)

    def stats(self) -> dict[str, Any]:
        try:
            s = self.engine.stats().as_dict()
        except Exception as e:  # noqa: BLE001
            s = {"error": f"{type(e).__name__}: {e}"}
        s["queued"] = len(self._inbox)
        s["in_flight"] = len(self._in_flight)
        s["waiting_for_chunks"] = len(self._incoming)
        s["step_timers"] = self.timers.as_dict()
        return s

    def close(self) -> None:
        self.engine.close()
