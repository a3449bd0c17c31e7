"""In-process backend: every stage's StageWorkers (one per replica) in this process, stepped round-robin.

Threads: the stages take turns on the thread that polls them, so that thread runs torch with the CPUs the
whole pipeline reserves (threads.py: sum of num_cpus x replicas, at most this process's cores); the
caller's own count comes back when the pipeline closes in its thread."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from omni.config.schema import PipelineConfig
from omni.errors import BackendClosedError
from omni.pipeline.backend import StageEvent, Submission
from omni.pipeline.engine_factory import EngineFactory, make_engine
from omni.pipeline.graph import StageGraph
from omni.pipeline.replica_stats import merge_replica_stats
from omni.pipeline.stage_worker import StageWorker
from omni.pipeline.threads import ThreadsPerCaller, local_threads
from omni.stage_info import StageInfo

logger = logging.getLogger(__name__)


class LocalBackend:
    """Every stage in this process; `poll()` steps each worker with work once (round-robin).

    `replicas[stage]` holds one worker per replica (each its own engine and KV cache);
    `workers[stage]` is the first of them."""

    name = "local"

    def __init__(self, config: PipelineConfig, graph: StageGraph, engine_factory: EngineFactory | None = None):
        self.graph = graph
        self.replicas: dict[str, list[StageWorker]] = {}
        self._lock = threading.Lock()  # one thread steps the engines at a time
        self.threads = ThreadsPerCaller(local_threads(graph.stages.values()))
        try:
            for name in self.graph.order:
                stage = self.graph.stages[name]
                self.replicas[name] = []
                for _ in range(stage.replicas):
                    self.replicas[name].append(StageWorker(
                        stage, make_engine(stage, engine_factory), emit_hidden_states=self.graph.emits_hidden_states(name),
                        chunk_timeout_s=config.runtime.stream_chunk_timeout_s))
        except BaseException:
            self.close()
            raise
        self.infos: dict[str, StageInfo] = {name: ws[0].info for name, ws in self.replicas.items()}

    @property
    def workers(self) -> dict[str, StageWorker]:
        return {name: ws[0] for name, ws in self.replicas.items() if ws}

    def submit(self, sub: Submission) -> None:
        # In-process the upstream handles are the StageOutputs themselves: the worker takes it as is.
        if sub.stage not in self.replicas:
            raise BackendClosedError("the pipeline is closed", stage=sub.stage)
        self.replicas[sub.stage][sub.replica].submit(sub)

    def abort(self, stage: str, request_id: str, replica: int = 0) -> None:
        # Applied at once, so that the engine forgets the id before it can be reused.
        with self._lock:
            if stage not in self.replicas:  # closed: nothing runs any more
                return
            worker = self.replicas[stage][replica]
            worker.abort(request_id)
            worker.drain()

    def replica_states(self, stage: str) -> list[str]:
        return ["up"] * len(self.replicas[stage])

    def poll(self, timeout_s: float) -> list[StageEvent]:
        events: list[StageEvent] = []
        with self._lock:
            self.threads.apply()  # once per polling thread
            busy = False
            for name, workers in self.replicas.items():
                for i, worker in enumerate(workers):
                    if not worker.has_work():
                        continue
                    busy = True
                    result = worker.tick()
                    for to, rid, seq, chunk in result.chunks:  # stage to stage (the chosen replica), in-process
                        self.replicas[to.stage][to.replica].push_chunk(rid, seq, chunk)
                    events += [StageEvent(name, d.request_id, None, delta=d, replica=i) for d in result.deltas]
                    for full, summary in result.finished:
                        events.append(StageEvent(name, full.request_id, summary, full, replica=i))
        if not busy:  # nothing to do in-process: do not spin
            time.sleep(min(timeout_s, 0.005))
        return events

    def text(self, stage: str, op: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:  # never while a step runs
            if stage not in self.replicas:
                raise BackendClosedError("the pipeline is closed", stage=stage)
            return self.replicas[stage][0].text(op, *args, **kwargs)

    def stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            # The threads the stages step with (the polling thread's), not this caller thread's.
            return {name: {**merge_replica_stats([w.stats() for w in ws]), "torch_threads": self.threads.threads}
                    for name, ws in self.replicas.items()}

    def close(self) -> None:
        self.threads.restore()
        with self._lock:  # a poll in another thread (a generate still running) finishes its tick first
            replicas, self.replicas = self.replicas, {}
        for ws in replicas.values():
            for w in ws:
                try:
                    w.close()
                except Exception:  # noqa: BLE001
                    logger.exception("stage %s: close failed", w.name)
