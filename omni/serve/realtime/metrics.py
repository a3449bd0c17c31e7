"""Prometheus metrics of `/v1/realtime`, on the server's own registry (http/metrics.py's ServerMetrics):

    omni_realtime_sessions_open                   sessions connected now
    omni_realtime_sessions_total{outcome}         sessions ended: closed (by the client), idle, refused, error
    omni_realtime_turns_total{status}             responses ended: completed, cancelled, failed
    omni_realtime_turn_latency_seconds            commit (or speech stop) -> the response's first audio delta
    omni_realtime_barge_ins_total                 responses cancelled because the user started speaking
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RealtimeMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.open = Gauge("omni_realtime_sessions_open", "Realtime sessions connected now.", registry=registry)
        self.sessions = Counter("omni_realtime_sessions", "Realtime sessions ended, by outcome.", ["outcome"],
                                registry=registry)
        self.turns = Counter("omni_realtime_turns", "Realtime responses ended, by status.", ["status"],
                             registry=registry)
        self.turn_latency = Histogram("omni_realtime_turn_latency_seconds", "Commit or speech stop to the "
                                      "response's first audio delta.", buckets=_BUCKETS, registry=registry)
        self.barge_ins = Counter("omni_realtime_barge_ins", "Responses cancelled by the user speaking.",
                                 registry=registry)
