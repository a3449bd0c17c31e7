"""The Ray backend, driver side: one stage actor (actor.py) per stage replica.

    driver                       stage actor "thinker"            stage actor "talker"
    ------                       ---------------------            --------------------
    submit ────────────────────> queue -> step loop ─┐
    ray.wait(summary refs) <──── (summary, output) <─┘
    submit(talker, {thinker: output ref}) ──────────────────────> await output ref (actor-to-actor)
                                                                  processor -> queue -> step loop

The driver reads each submit() generator's deltas and summary and only forwards the full output's
ObjectRef to the downstream stages; chunks on streaming edges go actor to actor (actor.py).

Replicas: a stage with `replicas: N` is N actors, each with the stage's resources,
placed with Ray's SPREAD strategy (over the nodes that fit them). Each replica is gated
on its own after a failure (below): the others keep serving, and the router sends a
replica nothing while it restarts (`replica_states`). The requests a dying replica held
come back `replica_lost`, for the orchestrator to retry elsewhere or fail.

Every wait has a timeout; a dead actor fails the requests it was serving, and Ray
restarts it (`max_restarts`) for later ones. Connecting to Ray and letting go of it is
cluster.py.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError, RayTaskError

from omni import registry
from omni.config.schema import PipelineConfig, StageConfig
from omni.errors import BackendClosedError, ConfigError, StageError, StageStartError
from omni.messages import error_output
from omni.pipeline.backend import StageEvent, Submission
from omni.pipeline.engine_factory import EngineFactory
from omni.pipeline.graph import StageGraph
from omni.pipeline.ray.actor import StageActor
from omni.pipeline.ray.cluster import GET_TIMEOUT_S, HeldSignals, check_fits, init_ray, release, schedulable
from omni.pipeline.ray.failures import describe
from omni.pipeline.replica_stats import merge_replica_stats
from omni.stage_info import StageInfo

# How long one wait for the actors to start lasts before it looks at a held Ctrl-C / SIGTERM (HeldSignals).
_SIGNAL_SLICE_S = 0.2
MAX_ABORTS_KEPT = 256  # aborts remembered for a reused request id, before the finished ones are dropped

logger = logging.getLogger(__name__)


def _actor_name(pipeline: str, stage: StageConfig, replica: int, tag: str) -> str:
    """`omni.PIPELINE.STAGE.TAG`; with replicas `omni.PIPELINE.STAGE.REPLICA.TAG`."""
    return f"omni.{pipeline}.{stage.name}.{tag}" if stage.replicas == 1 else f"omni.{pipeline}.{stage.name}.{replica}.{tag}"


class RayBackend:
    """One Ray actor per stage replica; the orchestrator drives it from the caller's thread.

    `replica_actors[stage]` holds the actor of each replica; `actors[stage]` is the first."""

    name = "ray"

    def __init__(self, config: PipelineConfig, graph: StageGraph, engine_factory: EngineFactory | None = None):
        self.graph = graph
        for s in config.stages:
            if s.device == "cuda" and s.resources.num_gpus == 0:
                raise ConfigError(
                    f"stage {s.name!r}: device: 'cuda' needs resources.num_gpus > 0 on Ray "
                    "(Ray hides the GPUs from actors that reserve none); set resources.num_gpus, e.g. 1 or 0.5")
        self.replica_actors: dict[str, list[Any]] = {}
        self.infos: dict[str, StageInfo] = {}  # each stage's, asked once when its actors are ready
        self._pending: dict[Any, Submission] = {}  # the submit() generator of each request in flight
        # (stage, replica, request id) -> the abort sent there: a later request with that id waits for it
        self._aborts: dict[tuple[str, int, str], Any] = {}
        # Per (stage, replica): after a failure the replica is *gated* until it serves again (below).
        self._gates: dict[tuple[str, int], tuple[Any, float]] = {}  # -> (ready ref, deadline)
        self._deferred: dict[tuple[str, int], list[Submission]] = {}  # submissions waiting for the gate
        self._dead: dict[tuple[str, int], str] = {}  # -> why it will not come back
        self._events: list[StageEvent] = []  # produced without a round trip
        self._lock = threading.RLock()  # poll / submit / abort may come from several threads
        # One poller at a time: a submit() generator that one thread has read to its end cannot be
        # waited on by another (ray.wait: "owner is unknown"). Submit and abort do not wait for it.
        self._poll_lock = threading.Lock()
        self._start_timeout_s = config.runtime.stage_start_timeout_s
        self._owns_ray, self._temp_dir, self._temp_watcher = init_ray(config.runtime, config.stages)
        # Ctrl-C / SIGTERM while the actors start are held (cluster.HeldSignals): _wait_ready looks at them
        # between short waits, and the signal is delivered once the actors (and an embedded node) are let go of.
        held = HeldSignals()
        with held:
            try:
                self._start_actors(config, engine_factory, held)
            except BaseException:
                self.close()
                if not held:
                    raise
                # A start failure while a signal was held is the signal's doing: a SIGTERM or Ctrl-C sent to the
                # process group (timeout(1), a terminal) kills the stage actors too. The signal's way out.
            else:
                if held:
                    self.close()
        held.deliver()

    def _start_actors(self, config: PipelineConfig, engine_factory: EngineFactory | None,
                      held: HeldSignals) -> None:
        if not config.runtime.wait_for_nodes:  # at once, not after stage_start_timeout_s: no node can hold it
            check_fits(config.stages)
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
        self._wait_ready(config.runtime.stage_start_timeout_s, held)
        if not held:  # one call per stage, all at once: its first replica's facts
            refs = {name: actors[0].info.remote() for name, actors in self.replica_actors.items()}
            self.infos = {name: ray.get(ref, timeout=GET_TIMEOUT_S) for name, ref in refs.items()}

    @property
    def actors(self) -> dict[str, Any]:
        return {name: actors[0] for name, actors in self.replica_actors.items() if actors}

    def _where(self, stage: str, replica: int) -> str:
        """How an error names the replica ("" for a stage with one)."""
        return f"replica {replica}: " if self.graph.stages[stage].replicas > 1 else ""

    def _wait_ready(self, timeout_s: float, held: HeldSignals | None = None) -> None:
        """Every replica's ready() answered, its start error raised as soon as it comes; waits in short slices
        so that a held Ctrl-C / SIGTERM (`held`) ends the wait within one (the caller then lets go)."""
        refs = {actor.ready.remote(): (n, i) for n in self.graph.order
                for i, actor in enumerate(self.replica_actors[n])}
        not_ready = list(refs)
        deadline = time.monotonic() + timeout_s
        while not_ready and not held and (left := deadline - time.monotonic()) > 0:
            ready, not_ready = ray.wait(not_ready, num_returns=len(not_ready), timeout=min(left, _SIGNAL_SLICE_S))
            for ref in ready:
                self._check_started(ref, *refs[ref])
        if held:
            return
        if not_ready:
            names = list(dict.fromkeys(refs[r][0] for r in not_ready))
            wanted = {n: self.graph.stages[n].resources.model_dump() for n in names}
            raise StageStartError(
                f"stage(s) {', '.join(map(repr, names))} did not start within {timeout_s:g}s "
                f"(runtime.stage_start_timeout_s). Requested resources: {wanted}; "
                f"available in the cluster now: {schedulable(ray.available_resources())}", stage=names[0])

    def _check_started(self, ref: Any, name: str, i: int) -> None:
        """A replica's ready() answer: its start error (the stage's own, or its actor's death) raised."""
        where = f"stage {name!r}" + (f" (replica {i})" if self.graph.stages[name].replicas > 1 else "")
        try:
            ray.get(ref, timeout=GET_TIMEOUT_S)
        except RayTaskError as e:  # ready() raised the stage's start error
            if isinstance(e.cause, StageStartError):
                raise StageStartError(str(e.cause), stage=name) from None
            raise StageStartError(f"{where} failed to start: {describe(e)}", stage=name) from None
        except RayError as e:  # e.g. the actor process died while loading
            raise StageStartError(f"{where} failed to start: its Ray actor failed: {describe(e)}",
                                  stage=name) from None

    # ------------------------------------------------------------- backend
    # After a replica's actor fails, the replica is *gated*: a `ready()` call that Ray
    # retries across restarts tells when the restarted actor serves again; submissions to
    # it wait behind the gate (the orchestrator's request timeout still applies; its router
    # sends a gated replica nothing while another one serves). A gate that fails for good
    # marks the replica dead: its requests then fail at once with a clear error.
    # A submission that streams into a gated replica waits behind that gate too: its chunks go actor
    # to actor, fire and forget, and Ray fails a call made to an actor while it restarts, so chunks
    # sent then would be lost and the consumer would wait for them until its chunk timeout. And a consumer
    # whose producer waits behind a gate waits with it: sent at once, its first-chunk clock would run out
    # while the producer restarts.
    def submit(self, sub: Submission) -> None:
        with self._lock:
            self._route(sub)

    def _route(self, sub: Submission) -> None:
        stage, replica = key = (sub.stage, sub.replica)
        peer = next(((t.stage, t.replica) for t in sub.stream_to if (t.stage, t.replica) in self._dead), None)
        if key in self._dead or peer is not None:
            dead = key if key in self._dead else peer
            self._events.append(StageEvent(stage, sub.request_id, error_output(
                stage, sub.request_id, self._blame(sub, dead) + self._dead[dead]),
                replica=replica, replica_lost=key in self._dead))
        elif key in self._gates:
            self._deferred[key].append(sub)
        elif (gated := next(((t.stage, t.replica) for t in sub.stream_to if (t.stage, t.replica) in self._gates),
                            None)) is not None:
            self._deferred[gated].append(sub)
        elif (held := self._producer_held(sub)) is not None:
            self._deferred[held].append(sub)  # routed after its producer, which then feeds it
        else:
            self._send(sub)

    def _producer_held(self, sub: Submission) -> tuple[str, int] | None:
        """The gate its stream producer's submission waits behind, if it does: a consumer sent now would start
        its first-chunk clock while the producer restarts, and fail after stream_chunk_timeout_s."""
        if sub.stream_from is None:
            return None
        return next((key for key, subs in self._deferred.items()
                     if any(a.stage == sub.stream_from and a.request_id == sub.request_id for a in subs)), None)

    def replica_states(self, stage: str) -> list[str]:
        with self._lock:
            return ["dead" if (stage, i) in self._dead else "restarting" if (stage, i) in self._gates else "up"
                    for i in range(self.graph.stages[stage].replicas)]

    def _send(self, a: Submission) -> None:
        # The upstream refs ride inside the Submission (not as top-level arguments): Ray does not resolve
        # them, the actor awaits them itself, so an upstream failure becomes this request's error.
        after = self._aborts.pop((a.stage, a.replica, a.request_id), None)
        if after is not None:
            a = dataclasses.replace(a, after=after)
        gen = self.replica_actors[a.stage][a.replica].submit.remote(a)
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
                if a.stage == stage and a.replica == replica and a.request_id == request_id:
                    del self._pending[gen]
            for k in self._deferred:  # (a submission waits behind its own gate or a stream consumer's)
                self._deferred[k] = [a for a in self._deferred[k] if (a.stage, a.replica, a.request_id)
                                     != (stage, replica, request_id)]
            if stage in self.replica_actors and key not in self._dead and key not in self._gates:
                # fire and forget; a later request with this id on this replica waits for it (Submission.after)
                self._aborts[(stage, replica, request_id)] = self.replica_actors[stage][replica].abort.remote(
                    request_id)
                if len(self._aborts) > MAX_ABORTS_KEPT:  # those done no longer order anything
                    refs = list(self._aborts.values())
                    done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
                    self._aborts = {k: r for k, r in self._aborts.items() if r not in done}

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
                item = ray.get(ref, timeout=GET_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - RayError of all kinds: the request is lost on the stage
                del self._pending[gen]
                events.append(self._on_summary(a, e, None))
                break
            if item[0] == "delta":
                events.append(StageEvent(a.stage, a.request_id, None, delta=item[1], replica=a.replica))
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
            events.append(StageEvent(a.stage, a.request_id, item[1], output_ref, replica=a.replica))
        return events

    def _on_summary(self, a: Submission, error: BaseException | None, output_ref: Any) -> StageEvent:
        """The event of a request whose generator failed (`error`) or stopped early (None)."""
        rid = a.request_id
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
                                                         f"while serving the request: {describe(e)}")
        except GetTimeoutError:
            summary = error_output(a.stage, rid, f"{where}could not fetch the result within {GET_TIMEOUT_S:g}s")
        except RayTaskError as e:
            summary = error_output(a.stage, rid, f"{where}stage task failed: {describe(e)}")
        except RayError as e:
            summary = error_output(a.stage, rid, where + describe(e))
        except Exception as e:  # noqa: BLE001 - e.g. a reply that does not unpickle
            summary = error_output(a.stage, rid, f"{where}bad reply from the stage: {describe(e)}")
        return StageEvent(a.stage, rid, summary, output_ref, replica=a.replica, replica_lost=lost)

    def _on_gate(self, key: tuple[str, int], ref: Any) -> list[StageEvent]:
        _, deadline = self._gates.pop(key)
        stage, replica = key
        try:
            ray.get(ref, timeout=GET_TIMEOUT_S)
        except RayError as e:
            if isinstance(e, ActorUnavailableError) and time.monotonic() < deadline:  # still restarting
                self._gates[key] = (self.replica_actors[stage][replica].ready.options(max_task_retries=-1).remote(),
                                    deadline)
                return []
            restarts = self.graph.stages[stage].max_restarts
            self._dead[key] = (f"the stage's Ray actor is dead and will not restart "
                               f"(max_restarts={restarts}): {describe(e)}")
            return self._fail_deferred(key, self._dead[key])
        for a in self._deferred.pop(key, []):
            self._route(a)  # another gate may hold it now (its own, or a stream consumer's)
        return []

    def _fail_deferred(self, key: tuple[str, int], error: str) -> list[StageEvent]:
        """Fail what waited behind the gate of `key` (the message names it): its own submissions, those of
        the stages streaming into it and those of its consumers (each reported as its own stage's event)."""
        return [StageEvent(a.stage, a.request_id,
                           error_output(a.stage, a.request_id, self._blame(a, key) + error),
                           replica=a.replica, replica_lost=(a.stage, a.replica) == key)
                for a in self._deferred.pop(key, [])]

    def _blame(self, sub: Submission, failed: tuple[str, int]) -> str:
        """The start of an error's message: the failed replica, named when it is not the submission's own."""
        if (sub.stage, sub.replica) == failed:
            return self._where(*failed)
        relation = "streaming into it" if failed[0] == sub.stream_from else "it streams into"
        return f"the stage {relation}, {failed[0]!r}, failed: {self._where(*failed)}"

    def text(self, stage: str, op: str, *args: Any, **kwargs: Any) -> Any:
        actors = self.replica_actors.get(stage)
        if not actors:
            raise BackendClosedError("the pipeline is closed", stage=stage)
        try:
            status, value = ray.get(actors[0].text.remote(op, args, kwargs), timeout=GET_TIMEOUT_S)
        except RayError as e:
            raise StageError(f"stage {stage!r}: {describe(e)}", stage=stage) from None
        if status == "error":
            raise value
        return value

    def stats(self) -> dict[str, dict[str, Any]]:
        refs = {name: [actor.stats.remote() for actor in actors] for name, actors in self.replica_actors.items()}
        out: dict[str, dict[str, Any]] = {}
        for name, stage_refs in refs.items():
            per_replica = []
            for ref in stage_refs:
                try:
                    per_replica.append(ray.get(ref, timeout=GET_TIMEOUT_S))
                except RayError as e:
                    per_replica.append({"error": describe(e)})
            out[name] = merge_replica_stats(per_replica, self.replica_states(name))
        return out

    def close(self) -> None:
        with self._lock:
            actors = [a for stage_actors in self.replica_actors.values() for a in stage_actors]
            self.replica_actors = {}
            self._pending.clear()
            self._gates.clear()
            self._deferred.clear()
        release(actors, self._owns_ray, self._temp_dir, self._temp_watcher, self._start_timeout_s)
        self._owns_ray, self._temp_dir, self._temp_watcher = False, None, None
