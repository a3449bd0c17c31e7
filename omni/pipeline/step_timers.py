"""Where a stage's step time goes, from timers in the code (`omni bench pipeline` reads them through stats()):

    tick_s       inside StageWorker.tick: the engine's step and the worker's bookkeeping (both backends)
    tick_cpu_s   the CPU time of the tick's thread meanwhile (less than tick_s: the thread waited for a core or
                 the GIL)
    hop_s        a Ray actor's hand-off of each tick to its step thread and back (executor round trip, minus tick_s)
    dispatch_s   a Ray actor's sending of what a tick produced: chunks to peers, deltas, replies
    gap_s        a Ray actor's event loop between two ticks of one busy stretch (other coroutines: submits,
                 chunk arrivals, stats calls)

A step's overhead on Ray is (hop_s + dispatch_s + gap_s) / ticks: what the actor adds to the tick itself.
Counters only (a few time.perf_counter() calls a step); the bench takes differences of two readings.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepTimers:
    ticks: int = 0
    tick_s: float = 0.0
    tick_cpu_s: float = 0.0
    hop_s: float = 0.0
    dispatch_s: float = 0.0
    gap_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def overhead_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per step, in ms, between two readings of a stage's timers: the tick, and what the actor added (split)."""
    ticks = max(1, int(after["ticks"] - before["ticks"]))
    per = {k: (after[k] - before[k]) * 1000 / ticks
           for k in ("tick_s", "tick_cpu_s", "hop_s", "dispatch_s", "gap_s")}
    return {"steps": ticks, "tick_ms": per["tick_s"], "tick_cpu_ms": per["tick_cpu_s"], "hop_ms": per["hop_s"],
            "dispatch_ms": per["dispatch_s"],
            "gap_ms": per["gap_s"], "overhead_ms": per["hop_s"] + per["dispatch_s"] + per["gap_s"]}
