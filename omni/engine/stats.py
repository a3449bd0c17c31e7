"""The counters a stage keeps of its requests and steps, as StageStats reports them.

Kept apart from the engine loop so that the loop only bumps numbers (a few additions per step) and the
summary (TTFT mean and median over the latest finished requests) is computed when stats are asked for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# TTFTs kept for the summary: the latest ones, so that a long-running stage reports its present.
_TTFT_WINDOW = 1000


@dataclass(slots=True)
class StepCounters:
    finished: int = 0
    errors: int = 0
    steps: int = 0
    step_time_s: float = 0.0
    ttfts: list[float] = field(default_factory=list)

    def record_finished(self, ttft: float | None) -> None:
        self.finished += 1
        if ttft is not None:
            self.ttfts.append(ttft)
            del self.ttfts[:-_TTFT_WINDOW]

    def record_step(self, seconds: float) -> None:
        self.steps += 1
        self.step_time_s += seconds

    def stats_fields(self) -> dict[str, Any]:
        """The StageStats fields these counters fill."""
        ttfts = sorted(self.ttfts)
        return dict(finished=self.finished, errors=self.errors, steps=self.steps, step_time_s=self.step_time_s,
                    ttft_mean_s=(sum(ttfts) / len(ttfts)) if ttfts else None,
                    ttft_p50_s=ttfts[len(ttfts) // 2] if ttfts else None)
