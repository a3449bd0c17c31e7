"""How busy the whole machine's CPUs were over a stretch of a benchmark (Linux /proc/stat), so that a
capacity number comes with the machine's own limit beside it.

    with MachineCPU() as cpu:
        ...                       # the level's requests
    cpu.busy                      # fraction of all CPUs' time not idle (None where /proc/stat is absent)
    cpu.cores                     # CPUs the kernel counts (the fraction's denominator)

Why the machine and not the stage actors' own counters: a pipeline's cost is also the driver, Ray's
daemons and the transfers between processes; what bounds audio per second is whether the cores have
time left at all (`omni bench capacity`: `machine_cpu_busy`, `core_s_per_audio_s`, and the rate the
level's cost per audio second would allow on every core, `audio_s_per_s_cpu_ceiling`).
"""
from __future__ import annotations

import os


def _ticks() -> tuple[int, int] | None:
    """(all CPU ticks, idle + iowait ticks) since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user / nice]
    return sum(fields[:8]), fields[3] + fields[4]


class MachineCPU:
    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self.busy: float | None = None
        self._start: tuple[int, int] | None = None

    def __enter__(self) -> "MachineCPU":
        self._start = _ticks()
        return self

    def __exit__(self, *exc) -> None:
        end = _ticks()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return
        total, idle = end[0] - self._start[0], end[1] - self._start[1]
        self.busy = 1.0 - idle / total
