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


def stage_stats(engine: Any) -> Any:
    """StageEngine.stats(): the engine's counters, its KV cache's, its runner's, its rows' and its model's."""
    import torch

    from omni.engine.interface import StageStats

    kv = engine.kv.stats()
    extra = dict(engine.tensor_cache.stats()) if engine.tensor_cache is not None else {}
    extra.update(engine.runner.stats())
    extra.update(device=str(engine.model.device), **engine.rows.stats())
    extra.update(engine.model.stats())
    sched = engine.scheduler
    return StageStats(
        stage=engine.name, running=sched.num_running, waiting=sched.num_waiting,
        kv_usage=engine.kv.usage, num_blocks=engine.kv.num_blocks, max_model_len=engine.max_model_len,
        prefix_caching=engine.config.enable_prefix_caching, prefix_cache_queries=kv["queries"],
        prefix_cache_hits=kv["hits"], prefix_cache_hit_rate=kv["hit_rate"],
        preemptions=sched.num_preemptions, tensor_cache_time_s=engine.rows.time_s,
        torch_threads=torch.get_num_threads(), **engine.counters.stats_fields(), **engine.profile.stats(),
        extra=extra,
    )
