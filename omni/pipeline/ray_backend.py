"""Ray backend: one async actor per stage.

    driver                       stage actor "thinker"            stage actor "talker"
    ------                       ---------------------            --------------------
    submit ────────────────────> queue -> step loop ─┐
    ray.wait(summary refs) <──── (summary, output) <─┘
    submit(talker, {thinker: output ref}) ──────────────────────> await output ref (actor-to-actor)
                                                                  processor -> queue -> step loop

Each `submit` is a Ray streaming generator: it yields the request's deltas (tokens,
text: only when the caller streams), then a small *summary* the driver reads
(errors, text, token ids; arrays only for final stages), then the full output,
whose ObjectRef the driver only forwards, so hidden states never pass through it.

Streaming edges go actor to actor: a stage actor holds the names of the stages
it streams into (every replica of them) and pushes each chunk (numpy rows in Ray's
object store) to the replica the router chose for the request, in order, tagged with a
sequence number; the driver never sees a chunk.

Replicas: a stage with `replicas: N` is N actors, each with the stage's resources,
placed with Ray's SPREAD strategy (over the nodes that fit them). Each replica is gated
on its own after a failure (below): the others keep serving, and the router sends a
replica nothing while it restarts (`replica_states`). The requests a dying replica held
come back `replica_lost`, for the orchestrator to retry elsewhere or fail.

Inside the actor a background asyncio task steps the engine while there is
work; each step runs in a one-thread executor so the event loop keeps
accepting requests, aborts and stats calls, and all concurrent requests are
batched by the engine. Every wait has a timeout; a dead actor fails the
requests it was serving, and Ray restarts it (`max_restarts`) for later ones.

This is the only module of the runtime that imports Ray.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError, RayTaskError

from omni import registry
from omni.config import PipelineConfig, RuntimeConfig, StageConfig
from omni.errors import ConfigError, StageStartError
from omni.outputs import StageInput, StageOutput, error_output
from omni.pipeline.engine_factory import EngineFactory, make_engine, start_error
from omni.pipeline.graph import StageGraph
from omni.outputs import StageDelta
from omni.pipeline import temp_reaper
from omni.pipeline.orchestrator import StageEvent
from omni.pipeline.replica_stats import merge_replica_stats
from omni.pipeline.stage_worker import StageWorker, TickResult
from omni.pipeline.streaming import StreamTarget

logger = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Getting a ready summary or a stats answer is quick; this only bounds a hung node.
_GET_TIMEOUT_S = 30.0


def _first_line(text: str, limit: int = 400) -> str:
    lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe(e: BaseException) -> str:
    """What went wrong, by the exception's type: the original error of a failed task, the first line
    of Ray's own message otherwise."""
    if isinstance(e, RayTaskError) and e.cause is not None:
        return f"{type(e.cause).__name__}: {_first_line(str(e.cause))}"
    if isinstance(e, RayActorError):
        return _first_line(e.error_msg) or type(e).__name__
    return f"{type(e).__name__}: {_first_line(str(e))}"


@dataclass(slots=True)
class _Submission:
    stage: str
    replica: int
    request: StageInput
    upstream: dict[str, Any] | None
    sampling: Any
    keep_hidden: bool
    stream_to: tuple[StreamTarget, ...] = ()
    stream_from: str | None = None
    stream_out: bool = False


class StageActor:
    """The body of a stage actor (wrapped with ray.remote by RayBackend)."""

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
        try:
            registry.restore(registry_snapshot)  # registrations made in the driver
            self.worker = StageWorker(stage, make_engine(stage, engine_factory),
                                      emit_hidden_states=emit_hidden_states, chunk_timeout_s=chunk_timeout_s)
        except StageStartError as e:
            self._start_error = e
        except Exception as e:  # noqa: BLE001 - e.g. the input processor does not resolve
            self._start_error = start_error(stage.name, e)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"omni-{stage.name}")
        # The reply slot of each submit() call in flight (the worker holds the request itself).
        self._futures: dict[str, asyncio.Future[tuple[StageOutput, StageOutput]]] = {}
        self._deltas: dict[str, asyncio.Queue[StageDelta]] = {}  # requests whose caller streams
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None

    async def ready(self) -> dict[str, Any]:
        if self._start_error is not None:
            raise self._start_error
        return {"stage": self.name, "replica": self.replica, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

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
            while self.worker.has_work():
                try:
                    result = await loop.run_in_executor(self._executor, self.worker.tick)
                except Exception as e:  # noqa: BLE001 - tick handles engine errors; this is a bug
                    logger.exception("stage %s: step loop error", self.name)
                    result = TickResult([(o, o) for o in (error_output(self.name, rid, f"step loop error: {e}")
                                                          for rid in list(self._futures))])
                self._dispatch(result)

    def _dispatch(self, result: TickResult) -> None:
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
    async def submit(self, request: StageInput, upstream: dict[str, Any] | None, sampling: Any,
                     keep_hidden: bool, stream_to: tuple[StreamTarget, ...] = (), stream_from: str | None = None,
                     stream_out: bool = False):
        """Yields ("delta", StageDelta)... (when the caller streams), ("done", summary for the
        driver), then the full output (for downstream stages; the driver only forwards its ref)."""
        self._ensure_loop()
        assert self.worker is not None  # the driver only submits to a stage that is ready
        rid = request.request_id
        fut: asyncio.Future[tuple[StageOutput, StageOutput]] = asyncio.get_running_loop().create_future()
        self._futures[rid] = fut
        queue: asyncio.Queue[StageDelta] | None = None
        if stream_out:
            queue = self._deltas[rid] = asyncio.Queue()
        outputs = None
        if upstream:
            # Upstream outputs come straight from the upstream actors' object stores.
            try:
                values = await asyncio.gather(*upstream.values())
                outputs = dict(zip(upstream.keys(), values))
            except Exception as e:  # noqa: BLE001
                out = error_output(self.name, rid, f"upstream output unavailable: {_describe(e)}")
                self._reply(rid, (out, out), fut)
        if not fut.done():  # not aborted while waiting for the upstream outputs
            self.worker.submit(request, outputs, sampling, keep_hidden, stream_to=stream_to,
                               stream_from=stream_from, stream_out=stream_out)
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

    async def stats(self) -> dict[str, Any]:
        if self.worker is None:
            return {"error": str(self._start_error)}
        # Through the executor: never read engine state while a step mutates it.
        s = await asyncio.get_running_loop().run_in_executor(self._executor, self.worker.stats)
        s["pid"] = os.getpid()
        s["node_id"] = ray.get_runtime_context().get_node_id()
        return s


def _ray_init(runtime: RuntimeConfig, stages: list[StageConfig]) -> tuple[bool, str | None, Any]:
    """Connect to / start Ray. Returns (we initialized it, temp dir to remove on close, its watcher)."""
    if ray.is_initialized():
        return False, None, None
    # ray.init makes SIGTERM exit the driver its own way: keep the application's handler
    # (the CLI's quiet exit, a server's graceful shutdown).
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    address = runtime.ray_address or os.environ.get("RAY_ADDRESS")
    if address:  # a cluster, or the cluster of the Ray job we run in
        ray.init(address=address, namespace=runtime.namespace, log_to_driver=runtime.log_to_driver)
        temp_dir, watcher = None, None
    else:
        # Embedded local Ray. Ray 2.60 turns token auth on by default; a private
        # throwaway cluster does not need it.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        temp_dir = tempfile.mkdtemp(prefix="omni-ray-")
        watcher = temp_reaper.watch(temp_dir)  # removes it if this driver is SIGKILLed
        # Logical CPUs only gate scheduling: never let a small machine leave a stage unplaced.
        num_cpus = max(os.cpu_count() or 1, math.ceil(sum(s.resources.num_cpus * s.replicas for s in stages)))
        ray.init(address="local", include_dashboard=False, _temp_dir=temp_dir, num_cpus=num_cpus,
                 namespace=runtime.namespace, log_to_driver=runtime.log_to_driver)
    if sigterm is not None:
        signal.signal(signal.SIGTERM, sigterm)
    return True, temp_dir, watcher


def _schedulable(resources: dict[str, float]) -> dict[str, float]:
    """The resources a stage can ask for (no node ids, no memory byte counts)."""
    return {k: round(v, 3) for k, v in sorted(resources.items())
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")}


def _actor_name(pipeline: str, stage: StageConfig, replica: int, tag: str) -> str:
    """`omni.PIPELINE.STAGE.TAG`; with replicas `omni.PIPELINE.STAGE.REPLICA.TAG`."""
    return f"omni.{pipeline}.{stage.name}.{tag}" if stage.replicas == 1 else f"omni.{pipeline}.{stage.name}.{replica}.{tag}"


class RayBackend:
    """One Ray actor per stage replica; the orchestrator drives it from the caller's thread.

    `replica_actors[stage]` holds the actor of each replica; `actors[stage]` is the first."""

    name = "ray"

    def __init__(self, config: PipelineConfig, graph: StageGraph | None = None,
                 engine_factory: EngineFactory | None = None):
        self.graph = graph or StageGraph(config.stages)
        for s in config.stages:
            if s.device == "cuda" and s.resources.num_gpus == 0:
                raise ConfigError(
                    f"stage {s.name!r}: device: 'cuda' needs resources.num_gpus > 0 on Ray "
                    "(Ray hides the GPUs from actors that reserve none); set resources.num_gpus, e.g. 1 or 0.5")
        self.replica_actors: dict[str, list[Any]] = {}
        self._pending: dict[Any, _Submission] = {}  # the submit() generator of each request in flight
        # Per (stage, replica): after a failure the replica is *gated* until it serves again (below).
        self._gates: dict[tuple[str, int], tuple[Any, float]] = {}  # -> (ready ref, deadline)
        self._deferred: dict[tuple[str, int], list[_Submission]] = {}  # submissions waiting for the gate
        self._dead: dict[tuple[str, int], str] = {}  # -> why it will not come back
        self._events: list[StageEvent] = []  # produced without a round trip
        self._lock = threading.RLock()  # poll / submit / abort may come from several threads
        # One poller at a time: a submit() generator that one thread has read to its end cannot be
        # waited on by another (ray.wait: "owner is unknown"). Submit and abort do not wait for it.
        self._poll_lock = threading.Lock()
        self._start_timeout_s = config.runtime.stage_start_timeout_s
        self._owns_ray, self._temp_dir, self._temp_watcher = _ray_init(config.runtime, config.stages)
        try:
            snap = registry.snapshot()
            tag = uuid.uuid4().hex[:8]
            names = {n: [_actor_name(config.name, self.graph.stages[n], i, tag)
                         for i in range(self.graph.stages[n].replicas)] for n in self.graph.order}
            # Consumers first: a stage that streams into others looks their replicas up by name.
            for name in reversed(self.graph.order):
                s = self.graph.stages[name]
                peers = {d: names[d] for d, _ in self.graph.streams_to(name)}
                self.replica_actors[name] = []
                for i in range(s.replicas):
                    cls = ray.remote(StageActor).options(
                        name=names[name][i],
                        num_cpus=s.resources.num_cpus,
                        num_gpus=s.resources.num_gpus,
                        resources=dict(s.resources.custom) or None,
                        max_restarts=s.max_restarts,
                        max_task_retries=0,
                        # Replicas over as many nodes as fit them: a node lost takes one replica, not all.
                        scheduling_strategy="SPREAD" if s.replicas > 1 else "DEFAULT",
                    )
                    self.replica_actors[name].append(cls.remote(
                        s, self.graph.emits_hidden_states(name), snap, engine_factory, peers,
                        config.runtime.stream_chunk_timeout_s, i))
            self._wait_ready(config.runtime.stage_start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def actors(self) -> dict[str, Any]:
        return {name: actors[0] for name, actors in self.replica_actors.items() if actors}

    def _where(self, stage: str, replica: int) -> str:
        """How an error names the replica ("" for a stage with one)."""
        return f"replica {replica}: " if self.graph.stages[stage].replicas > 1 else ""

    def _wait_ready(self, timeout_s: float) -> None:
        refs = {actor.ready.remote(): (n, i) for n in self.graph.order
                for i, actor in enumerate(self.replica_actors[n])}
        ready, not_ready = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            name, i = refs[ref]
            where = f"stage {name!r}" + (f" (replica {i})" if self.graph.stages[name].replicas > 1 else "")
            try:
                ray.get(ref, timeout=_GET_TIMEOUT_S)
            except RayTaskError as e:  # ready() raised the stage's start error
                if isinstance(e.cause, StageStartError):
                    raise StageStartError(str(e.cause), stage=name) from None
                raise StageStartError(f"{where} failed to start: {_describe(e)}", stage=name) from None
            except RayError as e:  # e.g. the actor process died while loading
                raise StageStartError(f"{where} failed to start: its Ray actor failed: {_describe(e)}",
                                      stage=name) from None
        if not_ready:
            names = list(dict.fromkeys(refs[r][0] for r in not_ready))
            wanted = {n: self.graph.stages[n].resources.model_dump() for n in names}
            raise StageStartError(
                f"stage(s) {', '.join(map(repr, names))} did not start within {timeout_s:g}s "
                f"(runtime.stage_start_timeout_s). Requested resources: {wanted}; "
                f"available in the cluster now: {_schedulable(ray.available_resources())}", stage=names[0])

    # ------------------------------------------------------------- backend
    # After a replica's actor fails, the replica is *gated*: a `ready()` call that Ray
    # retries across restarts tells when the restarted actor serves again; submissions to
    # it wait behind the gate (the orchestrator's request timeout still applies; its router
    # sends a gated replica nothing while another one serves). A gate that fails for good
    # marks the replica dead: its requests then fail at once with a clear error.
    def submit(self, stage: str, request: StageInput, upstream: dict[str, Any] | None, sampling: Any,
               keep_hidden: bool, *, replica: int = 0, stream_to: tuple[StreamTarget, ...] = (),
               stream_from: str | None = None, stream_out: bool = False) -> None:
        args = _Submission(stage, replica, request, upstream, sampling, keep_hidden, tuple(stream_to), stream_from,
                           stream_out)
        key = (stage, replica)
        with self._lock:
            if key in self._dead:
                self._events.append(StageEvent(stage, request.request_id, error_output(
                    stage, request.request_id, self._where(stage, replica) + self._dead[key]),
                    replica=replica, replica_lost=True))
            elif key in self._gates:
                self._deferred[key].append(args)
            else:
                self._send(args)

    def replica_states(self, stage: str) -> list[str]:
        with self._lock:
            return ["dead" if (stage, i) in self._dead else "restarting" if (stage, i) in self._gates else "up"
                    for i in range(self.graph.stages[stage].replicas)]

    def _send(self, a: "_Submission") -> None:
        gen = self.replica_actors[a.stage][a.replica].submit.remote(
            a.request, a.upstream, a.sampling, a.keep_hidden, a.stream_to, a.stream_from, a.stream_out)
        self._pending[gen] = a

    def _gate(self, stage: str, replica: int) -> None:
        key = (stage, replica)
        if key not in self._gates and key not in self._dead:
            ref = self.replica_actors[stage][replica].ready.options(max_task_retries=-1).remote()
            self._gates[key] = (ref, time.monotonic() + self._start_timeout_s)
            self._deferred.setdefault(key, [])

    def abort(self, stage: str, request_id: str, replica: int = 0) -> None:
        key = (stage, replica)
        with self._lock:
            for gen, a in list(self._pending.items()):
                if a.stage == stage and a.replica == replica and a.request.request_id == request_id:
                    del self._pending[gen]
            if key in self._deferred:
                self._deferred[key] = [a for a in self._deferred[key] if a.request.request_id != request_id]
            if stage in self.replica_actors and key not in self._dead and key not in self._gates:
                self.replica_actors[stage][replica].abort.remote(request_id)  # fire and forget

    def poll(self, timeout_s: float) -> list[StageEvent]:
        with self._poll_lock:
            return self._poll(timeout_s)

    def _poll(self, timeout_s: float) -> list[StageEvent]:
        with self._lock:
            events, self._events = self._events, []
            gate_refs = {g[0]: key for key, g in self._gates.items()}
            refs = list(self._pending) + list(gate_refs)
        if not refs:
            if not events:
                time.sleep(min(timeout_s, 0.01))
            return events
        # Wait without the lock: other threads may submit or abort meanwhile.
        ready, rest = ray.wait(refs, num_returns=1, timeout=0 if events else timeout_s)
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        with self._lock:
            for ref in ready:
                if ref in gate_refs:
                    if self._gates.get(gate_refs[ref], (None,))[0] == ref:
                        events += self._on_gate(gate_refs[ref], ref)
                elif ref in self._pending:  # else: aborted, or taken by another thread
                    events += self._on_items(ref)
            # Gates that ran out of time.
            now = time.monotonic()
            for key, (_, deadline) in list(self._gates.items()):
                if now >= deadline:
                    del self._gates[key]
                    events += self._fail_deferred(key, f"the stage's Ray actor did not come back within "
                                                       f"{self._start_timeout_s:g}s after it died")
        return events

    def _on_items(self, gen: Any) -> list[StageEvent]:
        """Read what a submit() generator has ready: deltas, then at the end (summary, output ref)."""
        a = self._pending[gen]
        events: list[StageEvent] = []
        while gen in self._pending:
            try:
                ref = next(gen)
            except StopIteration:  # ended without its summary: the actor was killed mid-reply
                del self._pending[gen]
                events.append(self._on_summary(a, None, None))
                break
            try:
                item = ray.get(ref, timeout=_GET_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - RayError of all kinds: the request is lost on the stage
                del self._pending[gen]
                events.append(self._on_summary(a, e, None))
                break
            if item[0] == "delta":
                events.append(StageEvent(a.stage, a.request.request_id, None, delta=item[1], replica=a.replica))
                ready, _ = ray.wait([gen], timeout=0)
                if not ready:
                    break
                continue
            del self._pending[gen]
            try:  # the full output follows its summary at once; the driver only forwards its ref
                output_ref = next(gen)
            except Exception as e:  # noqa: BLE001
                events.append(self._on_summary(a, e, None))
                break
            events.append(StageEvent(a.stage, a.request.request_id, item[1], output_ref, replica=a.replica))
        return events

    def _on_summary(self, a: "_Submission", error: BaseException | None, output_ref: Any) -> StageEvent:
        """The event of a request whose generator failed (`error`) or stopped early (None)."""
        rid = a.request.request_id
        where = self._where(a.stage, a.replica)
        lost = False
        try:
            if error is not None:
                raise error
            lost = True
            summary = error_output(a.stage, rid, where + "the stage's Ray actor stopped replying (killed?)")
        except RayActorError as e:
            # ActorDiedError, or ActorUnavailableError ("may or may not have been executed": in flight when
            # the actor died, or sent while it restarted). Either way this request is lost on this replica and
            # is not sent to it again: a request that crashed the actor would crash its restarted successor too.
            self._gate(a.stage, a.replica)
            lost = True
            summary = error_output(a.stage, rid, where + "the stage's Ray actor died or became unreachable "
                                                         f"while serving the request: {_describe(e)}")
        except GetTimeoutError:
            summary = error_output(a.stage, rid, f"{where}could not fetch the result within {_GET_TIMEOUT_S:g}s")
        except RayTaskError as e:
            summary = error_output(a.stage, rid, f"{where}stage task failed: {_describe(e)}")
        except RayError as e:
            summary = error_output(a.stage, rid, where + _describe(e))
        except Exception as e:  # noqa: BLE001 - e.g. a reply that does not unpickle
            summary = error_output(a.stage, rid, f"{where}bad reply from the stage: {_describe(e)}")
        return StageEvent(a.stage, rid, summary, output_ref, replica=a.replica, replica_lost=lost)

    def _on_gate(self, key: tuple[str, int], ref: Any) -> list[StageEvent]:
        _, deadline = self._gates.pop(key)
        stage, replica = key
        try:
            ray.get(ref, timeout=_GET_TIMEOUT_S)
        except RayError as e:
            if isinstance(e, ActorUnavailableError) and time.monotonic() < deadline:  # still restarting
                self._gates[key] = (self.replica_actors[stage][replica].ready.options(max_task_retries=-1).remote(),
                                    deadline)
                return []
            restarts = self.graph.stages[stage].max_restarts
            self._dead[key] = (f"the stage's Ray actor is dead and will not restart "
                               f"(max_restarts={restarts}): {_describe(e)}")
            return self._fail_deferred(key, self._dead[key])
        for a in self._deferred.pop(key, []):
            self._send(a)
        return []

    def _fail_deferred(self, key: tuple[str, int], error: str) -> list[StageEvent]:
        stage, replica = key
        return [StageEvent(stage, a.request.request_id,
                           error_output(stage, a.request.request_id, self._where(stage, replica) + error),
                           replica=replica, replica_lost=True)
                for a in self._deferred.pop(key, [])]

    def stats(self) -> dict[str, dict[str, Any]]:
        refs = {name: [actor.stats.remote() for actor in actors] for name, actors in self.replica_actors.items()}
        out: dict[str, dict[str, Any]] = {}
        for name, stage_refs in refs.items():
            per_replica = []
            for ref in stage_refs:
                try:
                    per_replica.append(ray.get(ref, timeout=_GET_TIMEOUT_S))
                except RayError as e:
                    per_replica.append({"error": _describe(e)})
            out[name] = merge_replica_stats(per_replica, self.replica_states(name))
        return out

    def close(self) -> None:
        with self._lock:
            actors = [a for stage_actors in self.replica_actors.values() for a in stage_actors]
            self.replica_actors = {}
            self._pending.clear()
            self._gates.clear()
            self._deferred.clear()
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        elif ray.is_initialized():
            # ray.kill only asks the GCS; on a cluster we do not own, wait until
            # the actors are really gone so their CPUs/GPUs are free when close()
            # returns (a pipeline reopened right after must be able to place).
            _wait_dead(actors, self._start_timeout_s)
        self._owns_ray = False
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
        temp_reaper.stop(self._temp_watcher)
        self._temp_watcher = None


def _wait_dead(actors: list[Any], timeout_s: float) -> None:
    """Probe each killed actor until calls to it fail (the kill has landed)."""
    deadline = time.monotonic() + timeout_s
    for actor in actors:
        while (left := deadline - time.monotonic()) > 0:
            try:
                ray.get(actor.ready.remote(), timeout=min(left, _GET_TIMEOUT_S))
            except GetTimeoutError:
                continue  # busy in a step; the kill still lands, the deadline bounds us
            except RayActorError:
                break  # the kill has landed
            except RayTaskError:
                pass  # alive, its ready() raising its start error: the kill has not landed yet
            time.sleep(0.05)
        else:
            logger.warning("stage actor still alive %.0fs after ray.kill", timeout_s)
