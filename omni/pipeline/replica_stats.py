"""One stage's stats over its replicas (both backends): the stage's totals, and each replica's own.

    {"running": 3, "prefix_cache_hit_rate": 0.82, ..., "replicas": [{"replica": 0, "state": "up",
     "prefix_cache_hit_rate": 0.85, "running": 2, "kv_usage": 0.4, ...}, {"replica": 1, ...}]}

Counters add up (busy time too: replica-seconds), the hit rate is recomputed from the summed queries and hits, the mean TTFT is
weighted by finished requests, KV usage is the mean; anything else (max_model_len, device, ...)
is the first live replica's. A stage with one replica keeps its flat stats (no "replicas").
"""
from __future__ import annotations

from typing import Any

_SUM = ("running", "waiting", "num_blocks", "prefix_cache_queries", "prefix_cache_hits", "preemptions",
        "finished", "errors", "steps", "step_time_s", "tensor_cache_time_s", "queued", "in_flight",
        "waiting_for_chunks", "batch_calls", "batched_items", "busy_time_s", "forward_time_s",
        "sampling_time_s", "host_time_s", "finish_thread_time_s")
_MAX = ("max_batch",)


def merge_replica_stats(per_replica: list[dict[str, Any]], states: list[str] | None = None) -> dict[str, Any]:
    """`per_replica[i]`: replica i's stats (or {"error": ...}); `states[i]`: "up" | "restarting" | "dead"."""
    states = states or ["up"] * len(per_replica)
    listed = [{"replica": i, "state": states[i], **s} for i, s in enumerate(per_replica)]
    if len(per_replica) == 1:
        return dict(per_replica[0])
    live = [s for s in per_replica if "error" not in s]
    if not live:
        return {"error": per_replica[0].get("error"), "replicas": listed}
    out = dict(live[0])
    out.pop("pid", None)  # one per replica: listed there
    for key in _SUM:
        if any(s.get(key) is not None for s in live):  # None: a counter this engine does not keep
            out[key] = sum(s.get(key) or 0 for s in live)
    for key in _MAX:
        if any(key in s for s in live):
            out[key] = max(s.get(key) or 0 for s in live)
    if "kv_usage" in out:
        out["kv_usage"] = sum(s.get("kv_usage") or 0.0 for s in live) / len(live)
    if "prefix_cache_queries" in out:
        q = out["prefix_cache_queries"]
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / q if q else 0.0
    timed = [(s["ttft_mean_s"], s.get("finished") or 0) for s in live if s.get("ttft_mean_s") is not None]
    if timed:
        n = sum(w for _, w in timed)
        out["ttft_mean_s"] = sum(t * w for t, w in timed) / n if n else sum(t for t, _ in timed) / len(timed)
        out["ttft_p50_s"] = None  # not recoverable from the replicas' medians
    out["replicas"] = listed
    return out
