"""Continuous batching of streams' pieces that take several steps (a one-shot model with `pieces_span_steps`).

A streamed request's output is cut into pieces (token2wav: a window of codes whose DiT ODE takes ten
Runge-Kutta steps). Each piece is a work item of the model's: an item is started as soon as its stream has
one ready (`start_item`) and advances one unit of work per engine step (`step_items`), packed with every
other item in flight, whatever stream it belongs to and however far along it is; an item whose work is
done (`item_done`) ends (`end_item`: its stream may start its next one) and is finished into its piece
(`finish_item`, e.g. the vocoder). So items of different streams share the model's calls whenever they
overlap, not only when they become ready in the same step. A stream's items run one after another.

First pieces go ahead: a stream's first item (short, for a short time to first output) runs to its end in
one step of its own, ahead of the others (they resume where they stopped), so its first output waits one
unit of the work in flight; the items held back then take their step before any further first item runs
alone (newcomers slow the streams already playing, never stop them). A step packs at most
`max_batch_tokens` of work (oldest first).

Threads (OneShotEngineConfig): with `finish_thread` a stream's later items are finished on the finish
thread (one, FIFO: a stream's pieces leave in order; pieces back together leave joined) while the stepping
thread goes on stepping; a first piece is still finished in the step its item ends (its time to first
output). A step with nothing in flight waits for the finish thread at most FINISH_POLL_S (no spinning, and
new input is admitted soon). With `compute_threads: 2` a step of several items runs as two packs of about
equal size (packs), one on the compute thread; `step_items` touches only its items, so the packs need no
lock. A pack that fails is stepped item by item in the stepping thread, so the item that fails fails its
stream alone (`step_items` changes no item unless it succeeds); a failure anywhere else (starting,
finishing) fails its stream alone too; an aborted stream's pieces are dropped when they come back.
"""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni.engine.one_shot_threads import WorkerThreads
from omni.engine.stage_model import OneShotStageModel

logger = logging.getLogger(__name__)

FINISH_POLL_S = 0.02  # longest a step with nothing else to do waits for the finish thread

Piece = tuple[dict[str, Any], bool]  # (a piece of output, whether it is the stream's last)


@dataclass(slots=True, eq=False)
class StreamWork:
    """The engine's side of one stream with pieces in flight (its model state is `state`)."""

    state: Any
    ended: int = 0  # its items whose work has ended (0: its next item is its first)
    flight: Flight | None = None  # its item in flight
    finishing: int = 0  # its items at the finish thread, not yet back
    dropped: bool = False
    pieces: list[dict[str, Any]] = field(default_factory=list)
    ready: Piece | Exception | None = None  # a finished piece (or failure) not yet taken


@dataclass(slots=True, eq=False)
class Flight:
    """A stream's item in flight: the model's item, its size (what a step's token budget counts)."""

    stream: StreamWork
    item: Any
    size: int
    first: bool  # the stream's first item: ahead of every other


@dataclass(slots=True, eq=False)
class _Finishing:
    """An item at the finish thread: its piece (or the exception) comes back in `future`."""

    stream: StreamWork
    future: Future
    last: bool


class InFlight:
    """The items in flight of one engine's streams, and the threads that step and finish them."""

    def __init__(self, model: OneShotStageModel, finish_thread: bool = False, compute_threads: int = 1):
        self.model = model
        self.finish_thread = finish_thread
        self.compute_threads = compute_threads
        self.threads = WorkerThreads()
        self.flights: list[Flight] = []  # in admission order
        self.finishing: deque[_Finishing] = deque()  # in submission order
        self._held = 0  # 1: the last step ran first items while others waited (they go next)

    def ready(self, work: StreamWork) -> bool:
        """Whether the stream has anything for a step: a piece, work in flight, or an item to start."""
        return (work.ready is not None or work.flight is not None or work.finishing > 0
                or self.model.stream_ready(work.state))

    def step(self, streams: list[StreamWork], max_tokens: int | None) -> list[Piece | Exception | None]:
        """One engine step: the given streams' next items are started (those ready and not in flight),
        the items in flight step, those whose work ends are finished, and each given stream gets its
        piece once done: None while in flight, the exception when it failed."""
        with torch.inference_mode():
            self._collect()
            for work in streams:
                if work.flight is None and not isinstance(work.ready, Exception):
                    self._start(work)
            if self.flights:
                self._step(max_tokens)
            elif self.finishing and all(work.ready is None for work in streams):
                wait_futures([self.finishing[0].future], timeout=FINISH_POLL_S)
            self._collect()
        return [_take(work) for work in streams]

    def result(self, work: StreamWork) -> dict[str, Any]:
        """The whole output of a finished stream: its pieces' audio concatenated."""
        audio = [p["audio"] for p in work.pieces]
        joined = np.concatenate(audio) if audio else np.zeros(0, np.float32)
        return {**(work.pieces[-1] if work.pieces else {}), "audio": joined.astype(np.float32)}

    def stats(self) -> dict[str, Any]:
        # seconds the finish thread ran (outside the engine's steps)
        return {"finish_thread_time_s": self.threads.finish_time_s} if self.finish_thread else {}

    def drop(self, work: StreamWork) -> None:
        """An aborted stream: its item in flight goes (the others keep their steps)."""
        if work.flight is not None:
            self._land(work.flight, None)
        work.dropped = True
        work.ready = None

    def close(self) -> None:
        """The threads stop; nothing stays in flight (a later stream makes new threads)."""
        self.threads.close()
        self.flights.clear()
        self.finishing.clear()

    def _start(self, work: StreamWork) -> None:
        try:
            item = self.model.start_item(work.state)
            if item is None:
                return
            if self.model.item_done(item):  # nothing to step (an empty last piece)
                self._end(work, item, inline=work.finishing == 0)
                return
            size = self.model.item_size(item)
        except Exception as exc:  # noqa: BLE001 - this stream fails, not the others
            self._fail(work, exc)
            return
        work.flight = Flight(work, item, size, first=work.ended == 0)
        self.flights.append(work.flight)

    def _step(self, max_tokens: int | None) -> None:
        first = [f for f in self.flights if f.first]
        others_wait = len(first) < len(self.flights)
        # First items run to their end in one step of their own, so that a newcomer's first output waits
        # for one unit of the work in flight and is then not cut into steps that other stages' steps
        # interleave with (the local backend's one thread). The items held back take their step in the
        # next one, whatever arrived meanwhile.
        to_end = bool(first) and not (others_wait and self._held)
        self._held = int(to_end and others_wait)
        group: list[Flight] = []
        size = 0
        for f in first if to_end else self.flights:
            if group and max_tokens is not None and size + f.size > max_tokens:
                break
            group.append(f)
            size += f.size
        while True:
            live = [f for f in group if f.stream.flight is f and not self.model.item_done(f.item)]
            if not live:
                break
            self._step_packs(live)
            if not to_end:
                break
        for f in [f for f in group if f.stream.flight is f and self.model.item_done(f.item)]:
            self._land(f, None)
            # A stream's first piece is finished here, now (its time to first output); with the finish
            # thread, later ones go there and the stepping goes on with the items in flight meanwhile.
            self._end(f.stream, f.item, inline=f.first or not self.finish_thread)

    def _step_packs(self, group: list[Flight]) -> None:
        """One step of the group's items together (with two compute threads, in two packs, one on the
        compute thread); a pack that fails is stepped item by item, so only an item that fails alone fails."""
        split = packs(group) if self.compute_threads > 1 else [group]
        if len(split) == 1:
            errors = [self._try_step(group)]
        else:
            other = self.threads.compute(self._try_step, split[1])
            errors = [self._try_step(split[0]), other.result()]
        for pack, exc in zip(split, errors):
            if exc is None:
                continue
            if len(pack) == 1:
                self._land(pack[0], exc)
                continue
            logger.error("a step of %d items failed; stepping each alone", len(pack), exc_info=exc)
            for f in pack:
                alone = self._try_step([f])
                if alone is not None:
                    self._land(f, alone)

    def _try_step(self, pack: list[Flight]) -> Exception | None:
        """step_items on the pack (in any thread: it touches only its items), or its exception."""
        try:
            self.model.step_items([f.item for f in pack])
        except Exception as exc:  # noqa: BLE001 - the caller fails the items, in the stepping thread
            return exc
        return None

    def _land(self, flight: Flight, error: Exception | None) -> None:
        """An item leaves the flights (done, or failed with `error`: its stream fails)."""
        if flight in self.flights:
            self.flights.remove(flight)
        if flight.stream.flight is flight:
            flight.stream.flight = None
            if error is not None:
                self._fail(flight.stream, error)

    def _end(self, work: StreamWork, item: Any, inline: bool) -> None:
        """An item's work has ended: its stream moves past it (its next item may start), and its piece is
        finished here (`inline`) or queued for the finish thread behind the stream's pieces already there."""
        last = self.model.end_item(item)
        work.ended += 1
        if inline and work.finishing == 0:
            try:
                piece = self.model.finish_item(item)
            except Exception as exc:  # noqa: BLE001 - this stream fails, not the others
                self._fail(work, exc)
                return
            self._deliver(work, piece, last)
            return
        work.finishing += 1
        self.finishing.append(_Finishing(work, self.threads.finish(self.model.finish_item, item), last))

    def _collect(self) -> None:
        """Pieces back from the finish thread go to their streams, in submission order."""
        while self.finishing and self.finishing[0].future.done():
            f = self.finishing.popleft()
            f.stream.finishing -= 1
            exc = f.future.exception()
            if exc is not None:
                self._fail(f.stream, exc)
            else:
                self._deliver(f.stream, f.future.result(), f.last)

    def _deliver(self, work: StreamWork, piece: dict[str, Any], last: bool) -> None:
        """A piece for the engine to take; one it has not taken yet leaves with it, joined (in order)."""
        if work.dropped or isinstance(work.ready, Exception):
            return
        work.pieces.append(piece)
        if work.ready is not None:
            piece = {**piece, "audio": np.concatenate([work.ready[0]["audio"], piece["audio"]])}
        work.ready = (piece, last)

    def _fail(self, work: StreamWork, error: Exception) -> None:
        """The stream fails with `error` (its item in flight stops; its pieces at the finish thread are ignored)."""
        if work.flight is not None:
            self._land(work.flight, None)
        work.dropped = True
        work.ready = error


def _take(work: StreamWork) -> Piece | Exception | None:
    result, work.ready = work.ready, None
    return result


def packs(group: list[Flight]) -> list[list[Flight]]:
    """The group in two packs of about equal size (largest item first into the lighter pack; each pack in
    the group's order), or one pack of a lone item."""
    if len(group) < 2:
        return [group]
    split: list[list[int]] = [[], []]
    load = [0, 0]
    for i in sorted(range(len(group)), key=lambda i: -group[i].size):
        k = 0 if load[0] <= load[1] else 1
        split[k].append(i)
        load[k] += group[i].size
    return [[group[i] for i in sorted(p)] for p in split]
