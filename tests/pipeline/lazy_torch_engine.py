"""The fake engine that reports the torch threads its last step ran with, importing torch on its first step, not
before. Built from `lazy_threads_factory` (this module), a stage actor has no torch while it starts
(omni/pipeline/threads.py `set_process_torch_threads`), as with an engine that loads torch lazily; built from a
factory in a module that imports torch (tests/pipeline/test_threads.py), the actor has torch from the start.
This module must not import torch at its top."""
from __future__ import annotations

from omni.engine.interface import StageStats
from tests.fakes import FakeEngine


class ThreadsEngine(FakeEngine):
    """The fake engine, reporting the torch threads its last step ran with."""

    threads: int | None = None

    def step(self):
        import torch

        self.threads = torch.get_num_threads()
        return super().step()

    def stats(self) -> StageStats:
        s = super().stats()
        s.extra["step_threads"] = self.threads
        return s


def lazy_threads_factory(stage) -> ThreadsEngine:
    return ThreadsEngine(stage)
