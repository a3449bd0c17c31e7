"""Prometheus metrics of one server (its own registry: several apps in one process do not collide).

Measured by the server:
    omni_http_requests_total{path, status}                 every HTTP answer, errors included
    omni_requests_total{finish_reason}                     stop | length | abort (client left) | error
    omni_time_to_first_token_seconds{stage}                request arrival -> that stage's first token
    omni_time_to_first_audio_seconds                       request arrival -> first audio packet (TTFP)
    omni_e2e_request_latency_seconds                       request arrival -> reply complete
    omni_prompt_tokens_total, omni_generation_tokens_total, omni_cached_prompt_tokens_total
    omni_pending_requests                                  requests admitted and not finished
Read from the pipeline's stats() at each scrape (per stage):
    omni_stage_running_requests, omni_stage_waiting_requests, omni_stage_kv_cache_usage_ratio,
    omni_stage_prefix_cache_hit_rate, omni_stage_prefix_cache_{queries,hits}_total,
    omni_stage_tensor_cache_bytes, omni_stage_preemptions_total;
    omni_pipeline_requests_total{outcome}, omni_pipeline_requests_in_flight
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# stats() key -> (metric name, help, kind)
_STAGE_METRICS = {
    "running": ("omni_stage_running_requests", "Requests running in the stage's batch.", "gauge"),
    "waiting": ("omni_stage_waiting_requests", "Requests waiting in the stage's queue.", "gauge"),
    "kv_usage": ("omni_stage_kv_cache_usage_ratio", "Share of the stage's KV blocks in use (0..1).", "gauge"),
    "prefix_cache_hit_rate": ("omni_stage_prefix_cache_hit_rate", "Prefix-cache hit rate (tokens).", "gauge"),
    "prefix_cache_queries": ("omni_stage_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                             "counter"),
    "prefix_cache_hits": ("omni_stage_prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter"),
    "tensor_cache_bytes": ("omni_stage_tensor_cache_bytes", "Bytes held by the stage tensor cache.", "gauge"),
    "preemptions": ("omni_stage_preemptions", "Requests preempted (recomputed later) by the stage.", "counter"),
}


class _PipelineCollector:
    """Turns the latest stats() snapshot into metric families (set by `update` before each scrape)."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        stages = self.stats.get("stages", {})
        for key, (name, doc, kind) in _STAGE_METRICS.items():
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["stage"])
            for stage, s in stages.items():
                if isinstance(s.get(key), (int, float)):
                    fam.add_metric([stage], float(s[key]))
            yield fam
        reqs = self.stats.get("requests", {})
        outcomes = CounterMetricFamily("omni_pipeline_requests", "Requests the pipeline finished, by outcome.",
                                       labels=["outcome"])
        for outcome in ("finished", "failed", "aborted", "timed_out"):
            if outcome in reqs:
                outcomes.add_metric([outcome], float(reqs[outcome]))
        yield outcomes
        in_flight = GaugeMetricFamily("omni_pipeline_requests_in_flight", "Requests in the pipeline now.")
        if "in_flight" in reqs:
            in_flight.add_metric([], float(reqs["in_flight"]))
        yield in_flight


class ServerMetrics:
    """The server's metrics; also the Observer of each Run (first token, first audio)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http = Counter("omni_http_requests", "HTTP requests by path and status.", ["path", "status"], registry=r)
        self.finished = Counter("omni_requests", "Completions by finish reason (stop, length, abort, error).",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("omni_time_to_first_token_seconds", "Request arrival to a stage's first token.",
                              ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfp = Histogram("omni_time_to_first_audio_seconds", "Request arrival to the first audio packet.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("omni_e2e_request_latency_seconds", "Request arrival to the reply's end.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("omni_prompt_tokens", "Prompt tokens (the text stage).", registry=r)
        self.generation_tokens = Counter("omni_generation_tokens", "Generated tokens (the text stage).", registry=r)
        self.cached_tokens = Counter("omni_cached_prompt_tokens", "Prompt tokens found in the prefix cache "
                                     "(the text stage).", registry=r)
        self.pending = Gauge("omni_pending_requests", "Requests admitted and not finished.", registry=r)
        self._pipeline = _PipelineCollector()
        r.register(self._pipeline)

    # Observer
    def first_token(self, stage: str, seconds: float) -> None:
        self.ttft.labels(stage=stage).observe(seconds)

    def first_audio(self, seconds: float) -> None:
        self.ttfp.observe(seconds)

    def request_done(self, finish_reason: str, seconds: float, prompt: int, generated: int,
                     cached: int | None) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()
        if finish_reason not in ("abort", "error"):
            self.e2e.observe(seconds)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        if cached:
            self.cached_tokens.inc(cached)

    def render(self, stats: dict[str, Any] | None) -> bytes:
        if stats is not None:
            self._pipeline.stats = stats
        return generate_latest(self.registry)
