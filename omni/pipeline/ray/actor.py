"""The body of a stage actor: one replica of one stage, an async Ray actor.

    submit(Submission) ──> await the upstream output refs (actor to actor) ──> StageWorker queue
    step loop: while there is work, worker.tick()s in a one-thread executor ──> replies, chunks, deltas
    push_chunk() <── an upstream actor's chunk on a streaming edge;  abort(), stats(), ready()

Each `submit` is a Ray streaming generator: it yields the request's deltas (tokens,
text: only when the caller streams), then a small *summary* the driver reads
(errors, text, token ids; arrays only for final stages), then the full output,
whose ObjectRef the driver only forwards, so hidden states never pass through it.

Streaming edges go actor to actor: a stage actor holds the names of the stages
it streams into (every replica of them) and pushes each chunk (numpy rows in Ray's
object store) to the replica the router chose for the request, in order, tagged with a
sequence number; the driver never sees a chunk.

A background asyncio task steps the engine while there is work: the steps run back to back in a
one-thread executor (a *stretch*, `_stretch`: no thread hand-off per step, each step's replies and
chunks handed to the event loop as it ends), so the event loop keeps accepting requests, aborts and
chunks, and all concurrent requests are batched by the engine; a stats or text call ends the stretch
after its current step and runs between two steps. That thread runs torch with the stage's
`resources.num_cpus` threads (threads.py; torch's count is per thread). What the actor adds to the
steps is timed (pipeline/step_timers.py; `omni bench pipeline` reports it).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from omni import registry
from omni.config.schema import StageConfig
from omni.errors import OmniError, StageError, StageStartError
from omni.messages import StageDelta, StageOutput, error_output
from omni.pipeline.backend import StreamTarget, Submission
from omni.pipeline.engine_factory import EngineFactory, make_engine, start_error
from omni.pipeline.ray.failures import describe
from omni.pipeline.stage_worker import StageWorker, TickResult
from omni.pipeline.threads import set_process_torch_threads, stage_threads
from omni.stage_info import StageInfo

logger = logging.getLogger(__name__)


class StageActor:
    """The body of a stage actor (wrapped with ray.remote by the driver's RayBackend, client.py)."""

    def __init__(self, stage: StageConfig, emit_hidden_states: bool, registry_snapshot: dict[str, Any],
                 engine_factory: EngineFactory | None, peers: dict[str, list[str]] | None = None,
                 chunk_timeout_s: float = 60.0, replica: int = 0):
        self.name = stage.name
        self.replica = replica
        # Stages this one streams into: stage -> the actor name of each replica, looked up on
        # first use (a name survives restarts on either side; a handle in the constructor
        # arguments would pin them in the object store).
        self.peers: dict[str, list[str]] = {k: list(v) for k, v in (peers or {}).items()}
        self._peer_handles: dict[tuple[str, int], Any] = {}
        self.worker: StageWorker | None = None
        # A start failure is kept and raised by ready(): the driver gets the exception itself
        # (RayTaskError.cause) instead of a dead actor, and Ray does not restart an actor
        # whose engine cannot be built.
        self._start_error: StageStartError | None = None
        threads = stage_threads(stage.resources.num_cpus)
        set_process_torch_threads(threads)  # loading (and any compute in it) in this thread too
        try:
            registry.restore(registry_snapshot)  # registrations made in the driver
            self.worker = StageWorker(stage, make_engine(stage, engine_factory),
                                      emit_hidden_states=emit_hidden_states, chunk_timeout_s=chunk_timeout_s)
        except StageStartError as e:
            self._start_error = e
        except Exception as e:  # noqa: BLE001 - e.g. the input processor does not resolve
            self._start_error = start_error(stage.name, e)
        # The one thread that runs the engine's steps (and stats): torch's thread count is set there.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"omni-{stage.name}",
                                            initializer=set_process_torch_threads, initargs=(threads,))
        # The reply slot of each submit() call in flight (the worker holds the request itself).
        self._futures: dict[str, asyncio.Future[tuple[StageOutput, StageOutput]]] = {}
        self._deltas: dict[str, asyncio.Queue[StageDelta]] = {}  # requests whose caller streams
        self._wake: asyncio.Event | None = None
        self._waiting_calls = 0  # stats / text calls waiting for the step thread (a stretch of ticks yields to them)
        self._loop_task: asyncio.Task[None] | None = None

    async def ready(self) -> dict[str, Any]:
        if self._start_error is not None:
            raise self._start_error
        return {"stage": self.name, "replica": self.replica, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    async def info(self) -> StageInfo:
        """The stage's StageInfo, read once when its engine was built; the driver asks once, after ready()."""
        assert self.worker is not None  # ready() answered: the stage started
        return self.worker.info

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    def _reply(self, rid: str, result: tuple[StageOutput, StageOutput],
               fut: asyncio.Future[tuple[StageOutput, StageOutput]] | None = None) -> None:
        """Answer the submit() call of `rid` (or `fut`, the one of a given call) once."""
        fut = fut if fut is not None else self._futures.get(rid)
        if fut is None:
            return
        if self._futures.get(rid) is fut:
            del self._futures[rid]
        if not fut.done():
            fut.set_result(result)

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None and self.worker is not None
        while True:
            # Sleep until there is work, or until a streamed input's chunk wait runs out.
            deadline = self.worker.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) + 0.01
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            timers = self.worker.timers  # (step_timers.py: what the actor adds to the ticks)
            while self.worker.has_work():
                t0 = time.perf_counter()
                try:
                    inside = await loop.run_in_executor(self._executor, self._stretch, loop)
                except Exception as e:  # noqa: BLE001 - tick handles engine errors; this is a bug
                    logger.exception("stage %s: step loop error", self.name)
                    inside = 0.0
                    self._dispatch(TickResult([(o, o) for o in (
                        error_output(self.name, rid, f"step loop error: {e}") for rid in list(self._futures))]))
                timers.hop_s += time.perf_counter() - t0 - inside

    def _stretch(self, loop: asyncio.AbstractEventLoop) -> float:
        """In the step thread: ticks back to back while there is work and no stats / text call waits for the
        thread, each tick's result handed to the event loop in order (call_soon_threadsafe) without waiting for
        it: no thread hand-off per step. Returns its own wall time (the rest of the executor call is the hop)."""
        timers, start = self.worker.timers, time.perf_counter()
        ticks = timers.tick_s
        while self.worker.has_work() and not self._waiting_calls:
            loop.call_soon_threadsafe(self._dispatch, self.worker.tick())
        inside = time.perf_counter() - start
        timers.gap_s += inside - (timers.tick_s - ticks)
        return inside

    def _dispatch(self, result: TickResult) -> None:
        t0 = time.perf_counter()
        try:
            self._send(result)
        finally:
            assert self.worker is not None
            self.worker.timers.dispatch_s += time.perf_counter() - t0

    def _send(self, result: TickResult) -> None:
        for to, rid, seq, chunk in result.chunks:
            # Actor to actor, in order (one caller, one handle); fire and forget: a lost
            # downstream fails its request through its own chunk timeout or the driver.
            self._peer(to).push_chunk.remote(rid, seq, chunk)
        for d in result.deltas:
            q = self._deltas.get(d.request_id)
            if q is not None:
                q.put_nowait(d)
        for full, summary in result.finished:
            self._reply(full.request_id, (full, summary))

    def _peer(self, target: StreamTarget) -> Any:
        key = (target.stage, target.replica)
        handle = self._peer_handles.get(key)
        if handle is None:
            handle = self._peer_handles[key] = ray.get_actor(self.peers[target.stage][target.replica])
        return handle

    @ray.method(num_returns="streaming")
    async def submit(self, sub: Submission):
        """Yields ("delta", StageDelta)... (when the caller streams), ("done", summary for the
        driver), then the full output (for downstream stages; the driver only forwards its ref)."""
        self._ensure_loop()
        assert self.worker is not None  # the driver only submits to a stage that is ready
        rid = sub.request_id
        if sub.after is not None:  # an earlier request's abort with this id: it lands first (Submission.after)
            with contextlib.suppress(Exception):
                await sub.after
            sub = dataclasses.replace(sub, after=None)
        fut: asyncio.Future[tuple[StageOutput, StageOutput]] = asyncio.get_running_loop().create_future()
        self._futures[rid] = fut
        queue: asyncio.Queue[StageDelta] | None = None
        if sub.stream_out:
            queue = self._deltas[rid] = asyncio.Queue()
        outputs = None
        if sub.upstream:
            # Upstream outputs come straight from the upstream actors' object stores.
            try:
                values = await asyncio.gather(*sub.upstream.values())
                outputs = dict(zip(sub.upstream.keys(), values))
            except Exception as e:  # noqa: BLE001
                out = error_output(self.name, rid, f"upstream output unavailable: {describe(e)}")
                self._reply(rid, (out, out), fut)
        if not fut.done():  # not aborted while waiting for the upstream outputs
            self.worker.submit(dataclasses.replace(sub, upstream=outputs))  # the outputs for their refs
            assert self._wake is not None
            self._wake.set()
        try:
            while queue is not None and not fut.done():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({fut, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield ("delta", getter.result())
                else:
                    getter.cancel()
            while queue is not None and not queue.empty():  # deltas of the step that finished it
                yield ("delta", queue.get_nowait())
        finally:
            if self._deltas.get(rid) is queue:
                self._deltas.pop(rid, None)
        full, summary = await fut
        yield ("done", summary)
        yield full

    async def push_chunk(self, request_id: str, seq: int, chunk: StageDelta) -> None:
        """A chunk of a streaming input, from the upstream stage's actor."""
        if self.worker is None:
            return
        self._ensure_loop()
        self.worker.push_chunk(request_id, seq, chunk)
        assert self._wake is not None
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._ensure_loop()
        out = error_output(self.name, request_id, f"request {request_id!r} was aborted", "abort")
        self._reply(request_id, (out, out))
        if self.worker is not None:
            self.worker.abort(request_id)
        assert self._wake is not None
        self._wake.set()

    async def text(self, op: str, args: tuple, kwargs: dict[str, Any]) -> tuple[str, Any]:
        """StageWorker.text, between steps: ("ok", its result) or ("error", the OmniError it raised), so that the
        driver re-raises the error itself (its type, field and code), not Ray's wrapper of it."""
        if self.worker is None:
            return "error", StageError(f"stage {self.name!r} did not start: {self._start_error}", stage=self.name)
        call = functools.partial(self.worker.text, op, *args, **kwargs)
        try:
            return "ok", await self._between_ticks(call)
        except OmniError as e:
            return "error", e

    async def _between_ticks(self, call: Any) -> Any:
        """`call` in the step thread between two ticks (never while a step mutates the engine): a stretch of ticks
        running now ends after its current tick."""
        self._waiting_calls += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        finally:
            self._waiting_calls -= 1

    async def stats(self) -> dict[str, Any]:
        if self.worker is None:
            return {"error": str(self._start_error)}
        # Through the executor: never read engine state while a step mutates it.
        s = await self._between_ticks(self.worker.stats)
        s["pid"] = os.getpid()
        s["node_id"] = ray.get_runtime_context().get_node_id()
        return s
