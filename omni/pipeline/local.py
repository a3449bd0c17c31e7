"""In-process backend: every StageEngine in this process, stepped round-robin.

`StageRunner` wraps one engine with the stage's input processor and the
bookkeeping both backends need (the Ray actor runs one StageRunner too):

    submit()/abort()  only queue (thread-safe: the Ray actor calls them from its event loop)
    tick()            applies the queue to the engine, runs one engine step, returns the
                      requests that finished: [(full output, summary for the driver)]

Engine calls happen in tick() alone, so one thread at a time touches the engine.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from omni.config import PipelineConfig, StageConfig
from omni.errors import StageStartError
from omni.outputs import StageInput, StageOutput
from omni.pipeline.graph import StageGraph
from omni.pipeline.orchestrator import StageEvent, build_stage_input, error_output, summarize

logger = logging.getLogger(__name__)

EngineFactory = Callable[[StageConfig], Any]


def default_engine_factory(stage: StageConfig) -> Any:
    from omni.engine.engine import StageEngine  # lazy: the driver of a Ray pipeline needs no engine

    return StageEngine.from_config(stage)


def make_engine(stage: StageConfig, engine_factory: EngineFactory | None) -> Any:
    try:
        return (engine_factory or default_engine_factory)(stage)
    except Exception as e:
        raise StageStartError(f"stage {stage.name!r} failed to start: {type(e).__name__}: {e}",
                              stage=stage.name) from e


class StageRunner:
    """One stage's engine + input processor + in-flight bookkeeping."""

    def __init__(self, stage: StageConfig, engine: Any):
        from stages.registry import resolve_input_processor

        self.stage = stage
        self.name = stage.name
        self.engine = engine
        self.processor = resolve_input_processor(stage.input_processor) if stage.input_processor else None
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._in_flight: dict[str, bool] = {}  # request id -> keep hidden states
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
            if rid in self._in_flight:
                self._fail(rid, f"request_id {rid!r} is already running on stage {self.name!r}")
                continue
            try:
                inp = build_stage_input(self.processor, request, upstream, sampling)
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
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail what is in flight, keep serving
                logger.exception("stage %s: engine step failed", self.name)
                outs = []
                for rid in list(self._in_flight):
                    del self._in_flight[rid]
                    try:
                        self.engine.abort(rid)
                    except Exception:  # noqa: BLE001
                        pass
                    self._fail(rid, f"engine step failed: {type(e).__name__}: {e}")
            for out in outs:
                if not (out.finished or out.error is not None):
                    continue  # streamed chunk: only whole outputs travel for now
                if out.finish_reason == "abort" and out.error is None:
                    continue  # the engine confirming one of our aborts (its id may be reused already)
                keep = self._in_flight.pop(out.request_id, None)
                if keep is not None:  # else: aborted here already
                    self._done(out, keep)
        ready, self._ready = self._ready, []
        return ready

    def stats(self) -> dict[str, Any]:
        try:
            s = dict(self.engine.stats())
        except Exception as e:  # noqa: BLE001
            s = {"error": f"{type(e).__name__}: {e}"}
        s["queued"] = len(self._inbox)
        s["in_flight"] = len(self._in_flight)
        return s

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


class LocalBackend:
    """Every stage in this process; `poll()` steps each stage with work once (round-robin)."""

    name = "local"

    def __init__(self, config: PipelineConfig, graph: StageGraph | None = None,
                 engine_factory: EngineFactory | None = None):
        self.graph = graph or StageGraph(config.stages)
        self.runners: dict[str, StageRunner] = {}
        self._lock = threading.Lock()  # one thread steps the engines at a time
        try:
            for name in self.graph.order:
                stage = self.graph.stages[name]
                self.runners[name] = StageRunner(stage, make_engine(stage, engine_factory))
        except BaseException:
            self.close()
            raise

    def submit(self, stage: str, request: StageInput, upstream: dict[str, Any] | None, sampling: Any,
               keep_hidden: bool) -> None:
        self.runners[stage].submit(request, upstream, sampling, keep_hidden)

    def abort(self, stage: str, request_id: str) -> None:
        # Applied at once, so that the engine forgets the id before it can be reused.
        with self._lock:
            runner = self.runners[stage]
            runner.abort(request_id)
            runner.drain()

    def poll(self, timeout_s: float) -> list[StageEvent]:
        events: list[StageEvent] = []
        with self._lock:
            busy = False
            for name, runner in self.runners.items():
                if runner.has_work():
                    busy = True
                    for full, summary in runner.tick():
                        events.append(StageEvent(name, full.request_id, summary, full))
        if not busy:  # nothing to do in-process: do not spin
            time.sleep(min(timeout_s, 0.005))
        return events

    def stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: r.stats() for name, r in self.runners.items()}

    def close(self) -> None:
        runners, self.runners = self.runners, {}
        for r in runners.values():
            try:
                r.close()
            except Exception:  # noqa: BLE001
                logger.exception("stage %s: close failed", r.name)
