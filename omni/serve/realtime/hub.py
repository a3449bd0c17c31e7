"""What a server's `/v1/realtime` sessions share: the pipeline, the server's settings, metrics and drain, and the
sessions open now."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omni.async_api import AsyncOmni
from omni.serve.http.metrics import ServerMetrics
from omni.serve.audio.vad import VadModels
from omni.serve.http.shutdown import Drain
from omni.serve.realtime.metrics import RealtimeMetrics
from omni.serve.settings import ServeSettings
from omni.serve.state import PipelineInfo, ServerState

if TYPE_CHECKING:
    from omni.serve.realtime.session import Session


class ClientGone(ConnectionError):
    """A session's event could not be sent: its client disconnected (a response it ran ends cancelled, not
    failed)."""


@dataclass
class RealtimeHub:
    """What the sessions share: the pipeline and the server's settings, metrics, drain and admission."""

    omni: AsyncOmni
    settings: ServeSettings
    info: PipelineInfo
    metrics: ServerMetrics  # the Observer of every run
    drain: Drain
    realtime_metrics: RealtimeMetrics
    state: ServerState  # its admission (admit / release): every response counts, as an HTTP request does
    vad_models: VadModels  # server VAD's models, reused from session to session
    sessions: set[Session] = field(default_factory=set)

    @classmethod
    def of(cls, state: ServerState) -> "RealtimeHub":
        return cls(state.omni, state.settings, state.info, state.metrics, state.drain,
                   RealtimeMetrics(state.metrics.registry), state, VadModels(state.settings.max_sessions))
