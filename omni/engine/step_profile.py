"""Where a stage's time goes: wall time split into forward / sampling / host work / waiting.

The engine adds up perf_counter intervals around the phases of its work (a few clock reads per step,
no tensors, no synchronisation):

    forward   the model's forward pass and its output head (logits)
    sampling  the sampler (logits -> tokens)
    host      everything else the engine does: scheduling, the runner's input buffers, rows into the
              tensor cache, the scheduler's update, deltas, outputs, releases, and admitting requests
              (preprocess, tokenization) and growing streamed ones
    waiting   the rest of the wall time: the stage had nothing to do (idle), or it was the pipeline's
              own work outside the engine (routing, input processors, transfers)

busy = forward + sampling + host. `window()` turns two snapshots of a stage's counters (its stats,
taken before and after a workload) and the wall time between them into fractions that add to 1 by
construction. On a GPU, kernels run asynchronously: their time lands where the host waits for them
(the sampler's copy of the tokens), not in `forward`.

An engine that does not split its steps (the one-shot engine) reports only `step_time_s`: its steps
are one model call each, so `window()` counts them as forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StepProfile:
    """A stage's accumulated time (seconds) since `started` (perf_counter)."""

    forward_s: float = 0.0
    sampling_s: float = 0.0
    busy_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    @property
    def host_s(self) -> float:
        return max(0.0, self.busy_s - self.forward_s - self.sampling_s)

    def stats(self) -> dict[str, float]:
        """The counters as a stage's stats carry them (flat keys; see window())."""
        return {"busy_time_s": self.busy_s, "forward_time_s": self.forward_s, "sampling_time_s": self.sampling_s,
                "host_time_s": self.host_s, "uptime_s": time.perf_counter() - self.started}


PHASES = ("forward", "sampling", "host", "waiting")


def window(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, float]:
    """Fractions of `wall_s` (the wall time between the two stats snapshots) the stage spent in each
    phase: {"stage_busy_fraction", "forward", "sampling", "host", "waiting"}. forward + sampling + host +
    waiting = 1; busy = 1 - waiting. A stage whose steps outlast the window (a step already running
    at the first snapshot) has waiting 0 and the phases scaled to its busy time."""

    def delta(key: str) -> float | None:
        a, b = after.get(key), before.get(key)
        return None if a is None else float(a) - float(b or 0.0)

    busy = delta("busy_time_s")
    if busy is None:  # an engine that does not split its steps: each is one model call
        busy = max(0.0, delta("step_time_s") or 0.0)
        forward, sampling = busy, 0.0
    else:
        forward, sampling = max(0.0, delta("forward_time_s") or 0.0), max(0.0, delta("sampling_time_s") or 0.0)
    busy = max(busy, forward + sampling, 0.0)
    total = max(wall_s, busy)
    if total <= 0:
        return {"stage_busy_fraction": 0.0, "forward": 0.0, "sampling": 0.0, "host": 0.0, "waiting": 1.0}
    host = busy - forward - sampling
    return {"stage_busy_fraction": busy / total, "forward": forward / total, "sampling": sampling / total,
            "host": host / total, "waiting": (total - busy) / total}
