"""The one-shot engine's worker threads: a finish thread and a second compute thread.

The finish thread runs a work item's last step (e.g. a vocoder turning a mel into samples) while the
stepping thread goes on with the items in flight: one thread, so finished pieces come back in the order
they were handed over (a stream's pieces leave in order). The compute thread steps one of the two packs
an engine step is split into, joined before the step ends. Both are made on first use, in the stepping
thread, and compute with its torch thread count (torch's count is per thread: omni/pipeline/threads.py),
the cores this stage was given; `close` stops them (a later step makes new ones).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class WorkerThreads:
    """The finish thread and the compute thread of one OneShotStageEngine."""

    def __init__(self) -> None:
        self._finish: ThreadPoolExecutor | None = None
        self._compute: ThreadPoolExecutor | None = None
        self.finish_time_s = 0.0  # written by the finish thread only (one writer), read by stats()

    @property
    def started(self) -> tuple[bool, bool]:
        """(finish thread made, compute thread made)."""
        return self._finish is not None, self._compute is not None

    def finish(self, fn: Callable[[Any], Any], item: Any) -> Future:
        """`fn(item)` on the finish thread (FIFO), timed into finish_time_s."""
        self._finish = self._finish or _pool("omni-finish")
        return self._finish.submit(self._timed, fn, item)

    def compute(self, fn: Callable[[Any], Any], item: Any) -> Future:
        """`fn(item)` on the compute thread."""
        self._compute = self._compute or _pool("omni-compute")
        return self._compute.submit(_inference, fn, item)

    def _timed(self, fn: Callable[[Any], Any], item: Any) -> Any:
        t = time.perf_counter()
        try:
            return _inference(fn, item)
        finally:
            self.finish_time_s += time.perf_counter() - t

    def close(self) -> None:
        """Both threads stop (work queued and not started is cancelled)."""
        for pool in (self._finish, self._compute):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._finish = self._compute = None


def _pool(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=torch.set_num_threads,
                              initargs=(torch.get_num_threads(),))


def _inference(fn: Callable[[Any], Any], item: Any) -> Any:
    with torch.inference_mode():
        return fn(item)
