"""Holding a stage's real engine from the test, across processes (a Ray actor), with files as the events.

`held()` (tests/serve/server_utils.py) holds an engine of this process; a stage actor is another process,
so here the events are files the test creates and removes (the actor runs on this machine and sees them):

    hold_file    while it exists, once `after_steps` steps have run with a request running in the engine, its
                 steps do nothing (no token, no finish, not an error: `EngineStepOutput()`, after a short
                 wait so that the actor does not spin) and its running request cannot finish, however fast
                 the machine is; stats, submissions and aborts are still answered between the steps
    start_file   while it exists, a new engine of the stage (a restarted actor's) waits before it is built,
                 so the actor stays "restarting" for as long as the test needs

`GatedFactory` is an `engine_factory` (picklable: the Ray backend sends it to the actors) that builds every
stage's engine as the config says (omni's own `build_engine`, or its `inner` factory: another GatedFactory
gates a second stage) and gates the named stage's.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from omni.engine.interface import EngineStepOutput
from omni.pipeline.engine_factory import build_engine

POLL_S = 0.01
START_WAIT_S = 120.0  # a start gate the test never removes fails the start, it does not hang it


class GatedEngine:
    """A real engine whose steps pause while `hold_file` exists, once `after_steps` steps ran a request."""

    def __init__(self, engine: Any, hold_file: str, after_steps: int = 1):
        self._engine, self._hold_file, self._after_steps = engine, hold_file, after_steps
        self._holding, self._ran = False, 0

    def __getattr__(self, name: str) -> Any:  # everything but step(): the engine's own
        return getattr(self._engine, name)

    def step(self) -> EngineStepOutput:
        if not os.path.exists(self._hold_file):
            self._holding, self._ran = False, 0
            return self._engine.step()
        if self._holding:
            time.sleep(POLL_S)
            return EngineStepOutput()
        out = self._engine.step()
        # Checked after the step, in the step's own thread: no step slips in between.
        if self._engine.stats().running > 0:
            self._ran += 1
            self._holding = self._ran >= self._after_steps
        return out


@dataclass(frozen=True)
class GatedFactory:
    stage: str
    hold_file: str
    start_file: str | None = None
    after_steps: int = 1
    inner: Any = None  # builds the other stages' engines (default: build_engine)

    def __call__(self, stage: Any) -> Any:
        if stage.name != self.stage:
            return (self.inner or build_engine)(stage)
        deadline = time.monotonic() + START_WAIT_S
        while self.start_file and os.path.exists(self.start_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the start gate {self.start_file} stayed for {START_WAIT_S:.0f} s")
            time.sleep(POLL_S)
        return GatedEngine(build_engine(stage), self.hold_file, self.after_steps)


def gate_files(tmp_path: Any) -> tuple[str, str]:
    """Paths for a hold file and a start file in `tmp_path` (not created)."""
    return str(tmp_path / "hold"), str(tmp_path / "start")


def engaged(path: str) -> None:
    open(path, "w").close()


def released(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)
