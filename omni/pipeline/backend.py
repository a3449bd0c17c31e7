"""The seam between the orchestrator and the stages: what crosses it, both ways.

    Orchestrator ──Submission──> Backend (local | ray) ──Submission──> StageWorker (of one replica)
    Orchestrator <──StageEvent── Backend.poll()        <──TickResult── StageWorker.tick()

A `Submission` is one request handed to one stage replica, the same object from the orchestrator
to the stage worker (on Ray it crosses to the actor as itself; the actor only swaps the upstream
handles for the outputs they point to). A `StageEvent` is what comes back: a stage finished or
failed a request, or reported a delta of a streamed one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from omni.messages import StageDelta, StageInput, StageOutput
from omni.stage_info import StageInfo


@dataclass(frozen=True, slots=True)
class StreamTarget:
    """A downstream stage (one replica of it) fed by one stage over a streaming edge."""

    stage: str
    chunk_tokens: int
    needs_rows: bool  # its input processor reads the upstream's per-token rows
    replica: int = 0  # which replica of `stage` the router chose: chunks go to that one only


@dataclass(frozen=True, slots=True)
class Submission:
    """One request for one stage replica."""

    stage: str
    request: StageInput  # the caller's request (the entry stage's input; ids, salt and prompt for the others)
    # Upstream stage -> its output: an opaque backend handle (an ObjectRef on Ray) between the orchestrator
    # and the backend, the StageOutput itself in the stage worker. None for an entry stage or a streamed input.
    upstream: dict[str, Any] | None = None
    sampling: Any = None  # this stage's SamplingParams (None: the stage's defaults)
    keep_hidden: bool = False  # the caller wants the per-token rows back
    replica: int = 0  # which replica of `stage` (the router's choice)
    stream_to: tuple[StreamTarget, ...] = ()  # consumers fed chunk by chunk while it runs
    stream_from: str | None = None  # its input arrives in chunks from that stage (push_chunk)
    stream_out: bool = False  # the caller streams: report deltas
    # Ray: the abort of an earlier request with this id on this replica, sent before this submission (an
    # ObjectRef the actor awaits first). An async actor's calls may run out of order: without it the abort could
    # land after the new request and fail it ("already in use"), or answer it as aborted.
    after: Any = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class StageEvent:
    """A stage finished (or failed) a request, or reported a delta of a streamed one."""

    stage: str
    request_id: str
    summary: StageOutput | None  # error set when the stage failed the request; None for a delta
    handle: Any = None  # what downstream stages get (backend-specific)
    delta: StageDelta | None = None
    replica: int = 0  # which replica of the stage
    # The replica died or became unreachable with the request in flight: it may be retried elsewhere.
    replica_lost: bool = False


class Backend(Protocol):
    """Runs the stages (omni.pipeline.local: in this process; omni.pipeline.ray: one actor per replica)."""

    # Each stage's StageInfo (its first replica's), read once when the stages started: what Omni.voices(),
    # context_reserve(), min_spoken_tokens(), shows_tools() and input_media() answer from, without a round trip.
    infos: dict[str, StageInfo]

    def submit(self, sub: Submission) -> None: ...
    def poll(self, timeout_s: float) -> list[StageEvent]: ...  # stages that finished a request (or streamed a delta)
    def abort(self, stage: str, request_id: str, replica: int = 0) -> None: ...
    def stats(self) -> dict[str, dict[str, Any]]: ...  # per stage (replicas merged, each listed under "replicas")
    # StageWorker.text on the stage's first replica (vLLM's /tokenize, /detokenize); raises the stage's OmniError
    def text(self, stage: str, op: str, *args: Any, **kwargs: Any) -> Any: ...
    def close(self) -> None: ...
    # Optional (missing: every replica "up"): "up" | "restarting" | "dead" per replica.
    def replica_states(self, stage: str) -> list[str]: ...
