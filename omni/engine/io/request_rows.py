"""Per-request per-token outputs of a stage, kept in a slot-mirrored row store.

The stage hands downstream the rows of *every* computed token of a request,
even when most came from the prefix cache. Each step writes the rows of all
its computed tokens into the store at the KV slot mapping (one index_copy for
the whole batch); when a request finishes, its rows are gathered once through
its block table:

    step k:   store[slot_mapping] = rows of the step's tokens
    finish:   rows = store[block_ids].flatten()[:num_computed_tokens]  -> numpy float32

Token j of a request lives at slot block_ids[j // block_size] * block_size +
j % block_size; a prefix-cache hit's rows were written there by the request
that first computed the block (the store is the stage tensor cache,
tensor_cache.py), and a preempted request's recomputed rows overwrite its new
slots. A running request's blocks are its own (ref count >= 1), and a finished
request's are gathered before anything can reuse them, so the rows are always
its own.

With prefix caching off the store is the same layout used privately (no
request ever reads another's blocks).

On a GPU stage a step's rows arrive through a side-stream copy
(rows_to_host.py); the store write runs on one background thread, in submission
order, so the step does not wait for it. Every operation goes through that
one queue (FIFO: a finished request is gathered before a later step's write
can touch its freed blocks); only gathering finished requests waits.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni.engine.io.rows_to_host import StagedRows
from omni.engine.tensor_cache import StageTensorCache

_WAIT_TIMEOUT_S = 120.0


@dataclass(slots=True)
class FinishedRows:
    hidden_states: np.ndarray | None
    mm_outputs: dict[str, np.ndarray]
    passthrough: dict[str, Any]


@dataclass(slots=True)
class RowsRequest:
    """What gathering a finished request's rows needs (host values, snapshot at finish)."""

    req_id: str
    block_ids: list[int]
    num_rows: int  # computed tokens: prompt + generated - 1
    num_hit_rows: int = 0  # of which came from the prefix cache (stats)


class _Serial:
    """Runs tasks in submission order: inline, or on one background thread."""

    def __init__(self, background: bool):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="omni-rows") if background else None
        self._last: Future | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.busy_s = 0.0  # time spent running tasks (on whichever thread)

    def _run(self, fn: Callable, *args) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except BaseException as exc:
            with self._lock:
                self._error = self._error or exc
            raise
        finally:
            self.busy_s += time.perf_counter() - t0

    def submit(self, fn: Callable, *args) -> Future | Any:
        if self._pool is None:
            return self._run(fn, *args)
        self._last = self._pool.submit(self._run, fn, *args)
        return self._last

    def call(self, fn: Callable, *args) -> Any:
        """Run `fn` after everything queued and return its result."""
        if self._pool is None:
            return self._run(fn, *args)
        result = self._pool.submit(self._run, fn, *args).result(timeout=_WAIT_TIMEOUT_S)
        self.raise_error()
        return result

    def raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"stage output rows failed on the background thread: {self._error}") from self._error

    def close(self) -> None:
        """Finish queued work and stop the thread; later calls run inline."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class OutputRows:
    def __init__(self, store: StageTensorCache, background: bool = False):
        self.store = store
        self._live: set[str] = set()
        self._passthrough: dict[str, dict[str, Any]] = {}
        self._serial = _Serial(background)
        self.time_s = 0.0  # time the engine's own thread spent on rows (inline work or waiting)
        self.deliver_time_s = 0.0  # of which gathering finished requests (waits included)
        self.write_time_s = 0.0  # storing each step's rows, on whichever thread runs it
        self.rows_delivered = 0

    @property
    def worker_time_s(self) -> float:
        """Time spent writing and gathering rows, on any thread."""
        return self._serial.busy_s

    def stats(self) -> dict[str, Any]:
        """The rows' counters as a stage's stats list them (StageStats.extra)."""
        return dict(tensor_cache_worker_time_s=self.worker_time_s, tensor_cache_write_time_s=self.write_time_s,
                    rows_deliver_time_s=self.deliver_time_s, rows_delivered=self.rows_delivered)

    def __contains__(self, req_id: str) -> bool:
        return self._serial.call(self._live.__contains__, req_id)

    def __len__(self) -> int:
        return self._serial.call(self._live.__len__)

    def _timed(self, fn: Callable, *args) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.time_s += time.perf_counter() - t0

    def add(self, req_id: str) -> None:
        self._timed(self._serial.submit, self._add, req_id)

    def drop(self, req_id: str) -> None:
        """Forget a request (queued behind the work already submitted: nothing waits)."""
        self._timed(self._serial.submit, self._drop, req_id)

    def collect(self, row_ranges: list[tuple[str, int, int]], rows: StagedRows | None,
                other: dict[str, torch.Tensor], slot_mapping: np.ndarray) -> None:
        """Store this step's rows (batch order = `row_ranges` order)."""
        self._timed(self._serial.submit, self._collect, row_ranges, rows, other, slot_mapping)

    def finish(self, requests: list[RowsRequest]) -> dict[str, FinishedRows]:
        """Gather the rows of requests that finished this step (one wait for all of them)."""
        if not requests:
            return {}
        t0 = time.perf_counter()
        try:
            return self._timed(self._serial.call, self._finish, requests)
        finally:
            self.deliver_time_s += time.perf_counter() - t0

    def read_range(self, req_id: str, block_ids: list[int], start: int, end: int) -> dict[str, np.ndarray]:
        """Rows [start, end) of a running request (after every queued write), float32 numpy."""
        return self._timed(self._serial.call, self._read_range, req_id, list(block_ids), start, end)

    def _read_range(self, req_id: str, block_ids: list[int], start: int, end: int) -> dict[str, np.ndarray]:
        if req_id not in self._live:
            raise ValueError(f"request_id: {req_id!r} does not keep per-token rows (return_hidden_states)")
        return {name: t.float().numpy() for name, t in self.store.gather(block_ids, end, start).items()}

    def close(self) -> None:
        self._serial.close()

    # ------------------------------------------------ the tasks (serialised)
    def _add(self, req_id: str) -> None:
        self._live.add(req_id)
        self._passthrough.pop(req_id, None)

    def _drop(self, req_id: str) -> bool:
        self._passthrough.pop(req_id, None)
        if req_id in self._live:
            self._live.discard(req_id)
            return True
        return False

    def _collect(self, row_ranges, staged: StagedRows | None, other, slot_mapping: np.ndarray) -> None:
        t0 = time.perf_counter()
        try:
            if staged is not None:
                self.store.write(torch.from_numpy(slot_mapping), staged.wait())
            if other:
                num_seqs = len(row_ranges)
                for i, (rid, _, _) in enumerate(row_ranges):
                    if rid not in self._live:
                        continue
                    # Per-request metadata: the request's entry when the tensor
                    # is per sequence, else the whole value.
                    slot = self._passthrough.setdefault(rid, {})
                    for name, t in other.items():
                        per_seq = isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == num_seqs
                        slot[name] = t[i] if per_seq else t
        finally:
            if staged is not None:
                staged.release()
            self.write_time_s += time.perf_counter() - t0

    def _finish(self, requests: list[RowsRequest]) -> dict[str, FinishedRows]:
        done = {}
        for r in requests:
            if r.req_id not in self._live:
                continue
            self._live.discard(r.req_id)
            full = {name: t.float().numpy() for name, t in self.store.gather(r.block_ids, r.num_rows).items()}
            self.rows_delivered += r.num_rows
            self.store.rows_served += r.num_hit_rows
            passthrough = {k: (v.cpu().numpy() if isinstance(v, torch.Tensor) else v)
                           for k, v in self._passthrough.pop(r.req_id, {}).items()}
            done[r.req_id] = FinishedRows(full.pop("hidden_states", None), full, passthrough)
        return done
