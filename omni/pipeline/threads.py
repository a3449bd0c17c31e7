"""Torch threads that fit the cores a stage reserves (`resources.num_cpus`), on both backends.

    Ray     each stage actor is its own process: its torch runs with floor(num_cpus) threads (at
            least 1, at most the node's CPUs), set in the thread that steps its engine
    local   every stage is in one process, stepped one after another by the one thread that polls
            them: only one stage computes at a time, so that thread gets the CPUs the whole pipeline
            reserves, sum(num_cpus x replicas) (at least 1, at most the cores this process may run on)

Why per thread: torch's OpenMP pool size is a per-thread setting (`omp_set_num_threads`); a thread
takes torch's global count on its first parallel op and keeps its own after, so the count must be
set in the thread that runs the forward passes (the Ray actor's step executor, the local backend's
polling thread). Why not per stage on the local backend: resizing the pool costs about a millisecond
(more than a small decode step), so one count serves every stage there.
"""
from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Iterable

from omni.config.schema import StageConfig


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS says, else the CPU count), and no
    more than OMP_NUM_THREADS where the environment sets it: a process given a thread budget (a test
    worker beside others, a container's share) keeps to it, as torch's own default count does."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this OS
        cores = max(1, os.cpu_count() or 1)
    budget = os.environ.get("OMP_NUM_THREADS", "")
    return min(cores, int(budget)) if budget.isdigit() and int(budget) > 0 else cores


def stage_threads(num_cpus: float, cores: int | None = None) -> int:
    """Threads of a stage running alone in its process (a Ray actor): its whole CPUs, >= 1, <= `cores`
    (default: os.cpu_count(), the node's CPUs: a reservation past them would only oversubscribe)."""
    cores = cores if cores is not None else max(1, os.cpu_count() or 1)
    return max(1, min(int(math.floor(num_cpus)), cores))


def local_threads(stages: Iterable[StageConfig], cores: int | None = None) -> int:
    """Threads of the local backend's polling thread: the CPUs all its stages reserve together (the
    stages take turns on that thread), >= 1, <= `cores` (default: available_cores())."""
    total = sum(s.resources.num_cpus * s.replicas for s in stages)
    return max(1, min(int(math.floor(total)), cores if cores is not None else available_cores()))


def set_torch_threads(n: int) -> None:
    """torch's intra-op threads of the calling thread (no-op when already so: resizing costs ~1 ms)."""
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def set_process_torch_threads(n: int) -> None:
    """torch's threads in a process of the stage's own (a Ray actor), without importing torch for an engine that
    never uses it (its import is much of a worker's start): a torch already imported gets n threads
    in the calling thread (set_torch_threads); one not imported yet starts with n in every thread, from
    OMP_NUM_THREADS / MKL_NUM_THREADS, which it reads once, at its import."""
    if "torch" in sys.modules:
        set_torch_threads(n)
    else:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)


class ThreadsPerCaller:
    """Applies a thread count to each thread that steps the stages (once per thread), and gives the
    caller's own count back when the pipeline closes in that thread (a user's torch code in the same
    thread computes as before)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._previous: dict[int, int] = {}  # thread id -> its count before we set ours
        self._lock = threading.Lock()

    def apply(self) -> None:
        ident = threading.get_ident()
        if ident in self._previous:
            return
        import torch

        with self._lock:
            self._previous[ident] = torch.get_num_threads()
        set_torch_threads(self.threads)

    def restore(self) -> None:
        """Back to the calling thread's own count (other threads keep ours until they end)."""
        with self._lock:
            previous = self._previous.pop(threading.get_ident(), None)
        if previous is not None:
            set_torch_threads(previous)
