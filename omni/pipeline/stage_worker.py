"""StageWorker: one stage's engine + input processor + in-flight bookkeeping (both backends).

The local backend runs one worker per stage in-process; the Ray backend runs one in
each stage actor. The worker is where an edge's input processor runs: on the
downstream side, on the upstream outputs it was handed.

    submit()/abort()  only queue (thread-safe: the Ray actor calls them from its event loop)
    tick()            applies the queue to the engine, runs one engine step, returns the
                      requests that finished: [(full output, summary for the driver)]

Engine calls happen in tick() alone, so one thread at a time touches the engine. A
request is in flight here from its add until the engine step that finishes it (its id
in the step's finished_req_ids) or until it is aborted; nothing else releases it.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any

from omni import registry
from omni.config import StageConfig
from omni.engine.interface import Engine
from omni.errors import OmniError
from omni.outputs import StageInput, StageOutput, error_output

logger = logging.getLogger(__name__)


# ------------------------------------------------------------ edge helpers
def passthrough_tokens(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Default input processor: the upstream generated token ids (concatenated, in `inputs` order)."""
    ids: list[int] = []
    for out in upstream.values():
        ids.extend(out.token_ids)
    return StageInput(request.request_id, prompt_token_ids=ids, cache_salt=request.cache_salt)


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


# ------------------------------------------------------------------ worker
class StageWorker:
    """One stage's engine + input processor + in-flight bookkeeping."""

    def __init__(self, stage: StageConfig, engine: Engine, *, emit_hidden_states: bool = True):
        """`emit_hidden_states`: every request hands its per-token rows out (a downstream stage reads
        them, see StageGraph.emits_hidden_states); otherwise only requests whose caller asks."""
        self.stage = stage
        self.name = stage.name
        self.engine = engine
        self.emit_hidden_states = emit_hidden_states
        self.processor = registry.resolve_input_processor(stage.input_processor) if stage.input_processor else None
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._in_flight: dict[str, bool] = {}  # request id -> the caller wants its rows back
        self._ready: list[tuple[StageOutput, StageOutput]] = []

    def submit(self, request: StageInput, upstream: dict[str, StageOutput] | None, sampling: Any,
               keep_hidden: bool) -> None:
        self._inbox.append(("add", request, upstream, sampling, keep_hidden))

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        return bool(self._inbox) or bool(self._ready) or self.engine.has_unfinished()

    def _done(self, out: StageOutput, keep_hidden: bool) -> None:
        self._ready.append((out, summarize(out, self.stage.final_output, keep_hidden)))

    def _fail(self, rid: str, error: str) -> None:
        self._done(error_output(self.name, rid, error), False)

    def drain(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "abort":
                # No output: whoever aborts has already finished the request on its side.
                if self._in_flight.pop(item[1], None) is not None:
                    self.engine.abort(item[1])
                continue
            _, request, upstream, sampling, keep_hidden = item
            rid = request.request_id
            try:
                inp = build_stage_input(self.processor, request, upstream, sampling)
                inp.return_hidden_states = keep_hidden or self.emit_hidden_states
            except Exception as e:  # noqa: BLE001 - a bad request must not take the stage down
                logger.exception("stage %s: input processor failed for %s", self.name, rid)
                self._fail(rid, f"input processor {self.stage.input_processor or 'passthrough_tokens'!r} "
                                f"failed: {type(e).__name__}: {e}")
                continue
            try:
                self.engine.add_request(inp)
            except Exception as e:  # noqa: BLE001
                self._fail(rid, f"invalid request: {type(e).__name__}: {e}")
                continue
            self._in_flight[rid] = keep_hidden

    def tick(self) -> list[tuple[StageOutput, StageOutput]]:
        """Apply queued adds/aborts, run one engine step; return the requests that finished."""
        self.drain()
        if self.engine.has_unfinished():
            try:
                step = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail what is in flight, keep serving
                logger.exception("stage %s: engine step failed", self.name)
                for rid in list(self._in_flight):
                    del self._in_flight[rid]
                    try:
                        self.engine.abort(rid)
                    except Exception:  # noqa: BLE001
                        logger.exception("stage %s: abort of %s failed", self.name, rid)
                    self._fail(rid, f"engine step failed: {type(e).__name__}: {e}")
            else:
                # step.aborted reports our own aborts: those entries are gone already.
                for out in step.finished:
                    keep = self._in_flight.pop(out.request_id, None)
                    if keep is not None:
                        self._done(out, keep)
        ready, self._ready = self._ready, []
        return ready

    def stats(self) -> dict[str, Any]:
        try:
            s = self.engine.stats().as_dict()
        except Exception as e:  # noqa: BLE001
            s = {"error": f"{type(e).__name__}: {e}"}
        s["queued"] = len(self._inbox)
        s["in_flight"] = len(self._in_flight)
        return s

    def close(self) -> None:
        self.engine.close()
