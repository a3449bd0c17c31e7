"""A fake engine that imports torch on its first step, not before: a stage actor built from it has no torch while it
starts (omni/pipeline/threads.py `set_process_torch_threads`), as an engine that loads torch lazily would.
This module must not import torch at its top."""
from __future__ import annotations

from omni.engine.interface import StageStats
from tests.fakes import FakeEngine


class LazyTorchThreadsEngine(FakeEngine):
    """The fake engine, reporting the torch threads its last step ran with; torch imported by its first step."""

    threads: int | None = None

    def step(self):
        import torch

        self.threads = torch.get_num_threads()
        return super().step()

    def stats(self) -> StageStats:
        s = super().stats()
        s.extra["step_threads"] = self.threads
        return s


def lazy_threads_factory(stage) -> LazyTorchThreadsEngine:
    return LazyTorchThreadsEngine(stage)
