"""This driver's hold on Ray: connecting to a cluster or starting an embedded one, and letting go.

    init_ray()      RAY_ADDRESS / runtime.ray_address: connect (a cluster, or the one of the Ray job we
                    run in); otherwise an embedded local Ray in a temp dir of its own, watched by
                    temp_reaper.py so that it outlives no driver (not even one killed with SIGKILL)
    release()       kill the stage actors, then shut the embedded Ray down (and remove its temp dir), or,
                    on a cluster we do not own, wait_dead(): until the actors are really gone
    schedulable()   what the cluster can give, in the words of a stage's `resources`
    check_fits()    a stage whose actor no node can hold is refused at once (Ray would leave it pending)
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from omni.config.schema import RuntimeConfig, StageConfig
from omni.errors import StageStartError
from omni.pipeline.ray import temp_reaper

logger = logging.getLogger(__name__)

# Getting a ready summary or a stats answer is quick; this only bounds a hung node.
GET_TIMEOUT_S = 30.0


def init_ray(runtime: RuntimeConfig, stages: list[StageConfig]) -> tuple[bool, str | None, Any]:
    """Connect to / start Ray. Returns (we initialized it, temp dir to remove on close, its watcher)."""
    if ray.is_initialized():
        return False, None, None
    # ray.init makes SIGTERM exit the driver its own way: keep the application's handler
    # (the CLI's quiet exit, a server's graceful shutdown).
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    address = runtime.ray_address or os.environ.get("RAY_ADDRESS")
    temp_dir, watcher = None, None
    # SIGTERM cannot be held here: ray.init sets its own handler first thing (the SystemExit below).
    held = HeldSignals((signal.SIGINT,))
    try:
        with held:
            if address:  # a cluster, or the cluster of the Ray job we run in
                ray.init(address=address, namespace=runtime.namespace, log_to_driver=runtime.log_to_driver)
            else:
                # Embedded local Ray. Ray 2.60 turns token auth on by default; a private
                # throwaway cluster does not need it.
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")
                temp_dir = tempfile.mkdtemp(prefix="omni-ray-")
                watcher = temp_reaper.watch(temp_dir)  # removes it if this driver is SIGKILLed
                # Logical CPUs only gate scheduling: never let a small machine leave a stage unplaced.
                num_cpus = max(os.cpu_count() or 1,
                               math.ceil(sum(s.resources.num_cpus * s.replicas for s in stages)))
                ray.init(address="local", include_dashboard=False, _temp_dir=temp_dir, num_cpus=num_cpus,
                         namespace=runtime.namespace, log_to_driver=runtime.log_to_driver)
    except SystemExit as e:
        # ray.init sets its own SIGTERM handler (sys.exit) first thing: a SIGTERM while it ran came this way
        if e.code != signal.SIGTERM:
            _abandon(temp_dir, watcher)
            raise
        held.received.insert(0, signal.SIGTERM)
        held.previous[signal.SIGTERM] = sigterm
    except BaseException:
        _abandon(temp_dir, watcher)  # a node half started is stopped, not left to linger
        raise
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    if held.received:  # Ctrl-C / SIGTERM while Ray started: let go of it, then take the signal's own way out
        _abandon(temp_dir, watcher)
        held.deliver()
    return True, temp_dir, watcher


def _abandon(temp_dir: str | None, watcher: Any) -> None:
    """Let go of a Ray this driver was starting: the node (or connection) stopped, its leftovers reaped."""
    try:
        ray.shutdown()
    finally:
        if temp_dir:
            _reap(temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)
        temp_reaper.stop(watcher)


class HeldSignals:
    """Ctrl-C (and SIGTERM) held while Ray starts something, then delivered once it is let go of.

    Interrupted midway, a Ray call that starts the node or the stage actors left the node's agents orphaned
    and sometimes crashed the driver in Ray's native code on its way out (an abort instead of exit 130/143).
    Inside `with`, the signals are recorded in `received` (the caller's waits run in short slices and look
    at it); a second Ctrl-C still interrupts at once (the user will not wait); an ignored signal stays
    ignored; off the main thread nothing is held (Python runs handlers there only). Once the caller has let
    go of what it started, `deliver()` runs the first signal's own handler (the CLI's: exit 130 or 143) and
    raises KeyboardInterrupt, the way out Ray's blocking calls let through."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
        self.signals = signals
        self.received: list[int] = []
        self.previous: dict[int, Any] = {}

    def __bool__(self) -> bool:
        return bool(self.received)

    def _hold(self, signum: int, frame: Any) -> None:
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt  # pressed again: the user will not wait
        self.received.append(signum)

    def __enter__(self) -> "HeldSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                previous = signal.getsignal(sig)
                if previous is not signal.SIG_IGN and previous is not None:
                    self.previous[sig] = signal.signal(sig, self._hold)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self.previous.items():
            if signal.getsignal(sig) == self._hold:  # (a bound method is a new object at each access)
                signal.signal(sig, previous)

    def deliver(self) -> None:
        """The first signal received, on its own handler's way out; KeyboardInterrupt if that handler returns."""
        if not self.received:
            return
        signum = self.received[0]
        handler = self.previous.get(signum)
        if callable(handler):
            handler(signum, None)
        raise KeyboardInterrupt


def _reap(temp_dir: str, grace_s: float = 2.0) -> None:
    """Stop what ray.shutdown left of the embedded node: processes of this user holding files under its temp
    dir (its logs). A node stopped while its agents were still starting (a Ctrl-C or SIGTERM during start-up)
    left them orphaned for a minute or more."""
    try:
        import psutil
    except ImportError:
        return
    mine, uid = os.getpid(), os.getuid()
    left_over = []
    for p in psutil.process_iter(["pid", "uids"]):
        try:
            if p.pid == mine or p.info["uids"] is None or p.info["uids"].real != uid:
                continue
            if any(f.path.startswith(temp_dir) for f in p.open_files()):
                left_over.append(p)
        except (psutil.Error, OSError):
            continue  # gone, or not ours to look at
    try:
        for p in left_over:
            p.terminate()
        _, alive = psutil.wait_procs(left_over, timeout=grace_s)
        for p in alive:
            p.kill()
    except psutil.Error:
        pass


def schedulable(resources: dict[str, float]) -> dict[str, float]:
    """The resources a stage can ask for (no node ids, no memory byte counts)."""
    return {k: round(v, 3) for k, v in sorted(resources.items())
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")}


def _demand(stage: StageConfig) -> dict[str, tuple[float, str]]:
    """One actor's demand in Ray's resource names, each with the field of `resources` that sets it."""
    r = stage.resources
    out = {"CPU": (r.num_cpus, "resources.num_cpus"), "GPU": (r.num_gpus, "resources.num_gpus")}
    out.update({name: (amount, f"resources.custom.{name}") for name, amount in r.custom.items()})
    return {key: (amount, field) for key, (amount, field) in out.items() if amount > 0}


def _holds(node: dict[str, float], demand: dict[str, tuple[float, str]]) -> bool:
    return all(node.get(key, 0.0) + 1e-9 >= amount for key, (amount, _) in demand.items())


def check_fits(stages: list[StageConfig]) -> None:
    """StageStartError for the first stage whose actor no alive node could hold even if it were idle: Ray
    leaves such an actor pending ("infeasible") without failing it, so the stage would only fail once
    runtime.stage_start_timeout_s ran out. An actor runs on one node, so a demand counts against each
    node's total, not the cluster's sum. A demand some node holds, but not now (its resources taken by
    other actors), is left to Ray: it is placed when they are freed, or times out as before. An autoscaling
    cluster adds nodes for pending actors: runtime.wait_for_nodes skips this check (the error says so)."""
    nodes = [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]
    for stage in stages:
        demand = _demand(stage)
        if not demand or any(_holds(node, demand) for node in nodes):
            continue
        where = f"stage {stage.name!r}"
        for key, (amount, field) in demand.items():  # a resource no node has enough of
            most = max((node.get(key, 0.0) for node in nodes), default=0.0)
            if amount > most + 1e-9:
                raise StageStartError(
                    f"{where}: {field}: the stage's actor asks for {amount:g} {key}, but no node of the Ray "
                    f"cluster has that many (the most any of its {len(nodes)} node(s) has: {most:g}); an actor "
                    f"runs on one node: lower {field} or add a node that has it (on an autoscaling cluster, "
                    f"runtime.wait_for_nodes: true waits up to stage_start_timeout_s for one)",
                    stage=stage.name, field=field, code="insufficient_resources", limit=most, actual=amount)
        # Every resource is on some node, never all of them on one.
        wanted = ", ".join(f"{amount:g} {key}" for key, (amount, _) in demand.items())
        have = "; ".join(", ".join(f"{node.get(key, 0.0):g} {key}" for key in demand) for node in nodes)
        raise StageStartError(
            f"{where}: resources: the stage's actor asks for {wanted} on one node, but no node of the Ray "
            f"cluster has all of it (its nodes: {have}; on an autoscaling cluster, runtime.wait_for_nodes: "
            f"true waits up to stage_start_timeout_s for one)", stage=stage.name, field="resources",
            code="insufficient_resources")


def _actor_name(pipeline: str, stage: StageConfig, replica: int, tag: str) -> str:
    """`omni.PIPELINE.STAGE.TAG`; with replicas `omni.PIPELINE.STAGE.REPLICA.TAG`."""
    return f"omni.{pipeline}.{stage.name}.{tag}" if stage.replicas == 1 else f"omni.{pipeline}.{stage.name}.{replica}.{tag}"



def wait_dead(actors: list[Any], timeout_s: float) -> None:
    """Probe each killed actor until calls to it fail (the kill has landed)."""
    deadline = time.monotonic() + timeout_s
    for actor in actors:
        while (left := deadline - time.monotonic()) > 0:
            try:
                ray.get(actor.ready.remote(), timeout=min(left, GET_TIMEOUT_S))
            except GetTimeoutError:
                continue  # busy in a step; the kill still lands, the deadline bounds us
            except RayActorError:
                break  # the kill has landed
            except RayTaskError:
                pass  # alive, its ready() raising its start error: the kill has not landed yet
            time.sleep(0.05)
        else:
            logger.warning("stage actor still alive %.0fs after ray.kill", timeout_s)


def release(actors: list[Any], owns_ray: bool, temp_dir: str | None, watcher: Any, timeout_s: float) -> None:
    """Kill the stage actors and let go of Ray: what init_ray() started goes, a cluster stays."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if owns_ray:
        if ray.is_initialized():
            ray.shutdown()
        if temp_dir:
            _reap(temp_dir)
    elif ray.is_initialized():
        # ray.kill only asks the GCS; on a cluster we do not own, wait until
        # the actors are really gone so their CPUs/GPUs are free when close()
        # returns (a pipeline reopened right after must be able to place).
        wait_dead(actors, timeout_s)
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)
    temp_reaper.stop(watcher)
