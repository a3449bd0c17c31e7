"""OneShotStageEngine: a one-shot stage (e.g. token2wav), same contract as StageEngine.

No KV cache, no prefix caching: a request is one call of the stage model (a OneShotStageModel: `prepare_generation`
when the request arrives, `run_generation` when it runs). Requests run in arrival order, up to `max_num_seqs` per
`step()`; a failing request fails alone. The queue is this engine's scheduler: a request lives in it from
add_request until its step (or abort).

Batched: a model with the optional hooks (`run_generation_batch`, `next_outputs`) gets the step's requests,
and the streams with a piece ready, in one call each (each under `max_batch_tokens` input tokens), equal to
the one-at-a-time hooks'. A batch that raises runs again one request at a time: the failing request fails alone.

A request whose input streams in (input_complete=False; a model with streaming input, e.g. token2wav fed codec
chunks) lives in `_streams` instead: its input grows through extend_request, and each step the model emits
whatever piece of output is ready (a StageDelta with `audio`); the finished output carries the pieces joined.

A model with `pieces_span_steps` (token2wav) computes a piece over several steps: this engine batches
those pieces continuously across requests and steps, with its worker threads (omni/engine/in_flight.py);
every stream with work ready or in flight goes into each step, first pieces first, and a stream's time to
first output is that of its first piece, not of the step that first took it.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni.errors import RequestError, StageError
from omni.messages import EdgePayload, StageDelta, StageInput, StageOutput
from omni.sampling_params import SamplingParams, resolve_sampling_params
from omni.stage_info import StageInfo

from omni.engine.in_flight import InFlight, StreamWork
from omni.engine.interface import EngineStepOutput, StageStats
from omni.engine.loading import load_stage_model
from omni.engine.stage_model import OneShotStageModel

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class OneShotEngineConfig:
    """Resolved configuration of one one-shot stage (built by omni.pipeline.engine_factory)."""

    name: str
    model_cls: type[OneShotStageModel]
    model_path: str | Path | None  # a local path (None when a loaded model is handed to the engine)
    max_num_seqs: int = 4  # requests run per step()
    # Most input tokens one batched model call computes (a request larger than that runs alone):
    # what bounds a batch's memory.
    max_batch_tokens: int = 2048
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    dtype: str = "float32"
    device: str = "auto"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    # Worker threads for a model with `pieces_span_steps` (omni/engine/in_flight.py): finish a stream's
    # later pieces on a thread of their own, and step the pieces in flight as two packs on two threads.
    finish_thread: bool = False
    compute_threads: int = 1


@dataclass(slots=True)
class _Job:
    inp: StageInput
    job: Any
    arrival: float
    tokens: list[int] = field(default_factory=list)  # streamed input: every token received
    first_output: float | None = None
    work: StreamWork | None = None  # a stream of a model with `pieces_span_steps`: its pieces in flight


class OneShotStageEngine:
    def __init__(self, config: OneShotEngineConfig, model: OneShotStageModel | None = None):
        self.config = config
        self.name = config.name
        if model is None:
            model = load_stage_model(config.name, config.model_cls, config.model_path, dtype=config.dtype,
                                     device=config.device, model_kwargs=config.model_kwargs)
        if model.info.autoregressive:
            raise ValueError(f"stage {self.name}: {type(model).__name__} is autoregressive; use StageEngine")
        self.model = model
        self.tokenizer = model.tokenizer
        self.in_flight = (InFlight(model, config.finish_thread, config.compute_threads)
                          if model.pieces_span_steps else None)
        self._queue: OrderedDict[str, _Job] = OrderedDict()
        self._streams: OrderedDict[str, _Job] = OrderedDict()
        self._aborted: list[StageOutput] = []
        self._num_finished = 0
        self._num_errors = 0
        self._num_steps = 0
        self._step_time = 0.0
        self._latencies: list[float] = []
        self._batch_calls = 0  # calls of a batched hook
        self._batched_items = 0  # requests or stream pieces those calls ran

    # ------------------------------------------------------------- requests
    def add_request(self, inp: StageInput) -> None:
        rid = inp.request_id
        if rid in self._queue or rid in self._streams:
            raise RequestError(f"request_id {rid!r} is already in use on this stage", stage=self.name,
                               field="request_id", code="duplicate_request_id", request_id=rid)
        seed = int(resolve_sampling_params(inp.sampling_params, self.config.default_sampling).seed or 0)
        if not inp.input_complete:
            if not self.model.info.streams_input:
                raise RequestError(f"stage {self.name!r}: {type(self.model).__name__} cannot take a streaming input",
                                   stage=self.name, field="input_complete")
            state = self.model.prepare_stream(inp, seed)
            self._streams[rid] = _Job(inp, state, time.monotonic(), list(inp.prompt_token_ids or []),
                                      work=None if self.in_flight is None else StreamWork(state))
            return
        job = self.model.prepare_generation(inp, seed)
        self._queue[rid] = _Job(inp, job, time.monotonic())

    @property
    def cuts_streamed_input(self) -> bool:
        """Whether a streamed input is cut into pieces of work as it grows (token2wav's windows), so that
        a stream whose whole input came at once must still be admitted as growing (StageWorker)."""
        return self.model.info.streams_input

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.work is not None:
            self.in_flight.drop(stream.work)  # its piece in flight stops counting
        job = self._queue.pop(request_id, None) or stream
        if job is not None:
            self._aborted.append(StageOutput(request_id, self.name, finished=True, finish_reason="abort",
                                             prompt_token_ids=list(job.inp.prompt_token_ids or [])))

    def has_unfinished(self) -> bool:
        """Queued requests, streams with output ready, or aborts to report."""
        return (bool(self._queue) or bool(self._aborted)
                or any(self._stream_ready(j) for j in self._streams.values()))

    def _stream_ready(self, job: _Job) -> bool:
        return self.model.stream_ready(job.job) if job.work is None else self.in_flight.ready(job.work)

    def extend_request(self, request_id: str, token_ids: list[int], prompt_embeds: Any = None,
                       last: bool = False, payload: EdgePayload | None = None) -> None:
        """More input for a request admitted with input_complete=False (ValueError when refused)."""
        job = self._streams.get(request_id)
        if job is None:
            raise ValueError(f"request_id: {request_id!r} is not a request of stage {self.name!r} waiting for input")
        self.model.extend_stream(job.job, StageInput(request_id, prompt_token_ids=list(token_ids), payload=payload),
                                 last)
        job.tokens += [int(t) for t in token_ids]

    def read_rows(self, request_id: str, start: int, end: int) -> dict[str, Any]:
        raise ValueError(f"stage {self.name!r} is a one-shot stage: it has no per-token rows to read")

    def close(self) -> None:
        if self.in_flight is not None:
            self.in_flight.close()
        self._queue.clear()
        self._streams.clear()
        self._aborted.clear()

    # ----------------------------------------------------------------- step
    def step(self) -> EngineStepOutput:
        out = EngineStepOutput(aborted=self._aborted)
        self._aborted = []
        t0 = time.perf_counter()
        budget = max(1, self.config.max_num_seqs)
        jobs = [self._queue.popitem(last=False) for _ in range(min(budget, len(self._queue)))]
        results = self._run(self.model.run_generation, self.model.run_generation_batch, [j.job for _, j in jobs])
        for (rid, job), produced in zip(jobs, results):
            res = StageOutput(rid, self.name, prompt_token_ids=list(job.inp.prompt_token_ids or []), finished=True)
            out.finished.append(res)
            if isinstance(produced, Exception):
                self._num_errors += 1
                res.finish_reason = "error"
                res.error = self._error(rid, produced)
                continue
            audio = produced.pop("audio", None)
            res.audio = None if audio is None else np.asarray(audio, dtype=np.float32)
            res.passthrough = produced
            res.finish_reason = "stop"
            latency = time.monotonic() - job.arrival
            res.metrics = {"ttft_s": latency, "e2e_s": latency}
            self._latencies = (self._latencies + [latency])[-1000:]
            self._num_finished += 1
        ran = len(jobs) + self._step_streams(out, budget)
        if ran:
            self._num_steps += 1
            self._step_time += time.perf_counter() - t0
        return out

    def _run(self, one: Callable[[Any], Any], batched: Callable[[list[Any], int], list[Any]] | None,
             items: list[Any]) -> list[Any]:
        """`one(item)` for each item, through the model's batched hook when it has one: each result, or
        the exception that item raised (one bad item never takes the others down)."""
        if batched is not None and len(items) > 1:
            try:
                results = list(batched(items, self.config.max_batch_tokens))
                if len(results) != len(items):
                    raise StageError(f"stage {self.name}: {type(self.model).__name__} returned {len(results)} "
                                     f"results for a batch of {len(items)}", stage=self.name)
            except Exception:  # noqa: BLE001 - find the failing item below, one at a time
                logger.exception("stage %s: a batch of %d failed; running its items one at a time",
                                 self.name, len(items))
            else:
                self._batch_calls += 1
                self._batched_items += len(items)
                return results
        results = []
        for item in items:
            try:
                results.append(one(item))
            except Exception as exc:  # noqa: BLE001 - one bad request never takes the stage down
                results.append(exc)
        return results

    def _error(self, rid: str, exc: Exception) -> StageError:
        logger.error("stage %s: request %s failed", self.name, rid, exc_info=exc)
        return StageError(f"stage {self.name}: generation failed: {type(exc).__name__}: {exc}",
                          stage=self.name, request_id=rid)

    def _step_streams(self, out: EngineStepOutput, budget: int) -> int:
        """Emit the next ready piece of up to `budget` streams (oldest first), together; finish those that end.

        First pieces go ahead: while some stream has its first piece ready, a step runs only first
        pieces (the others' later pieces run in the next step), so that a request's time to first
        output never includes other requests' longer windows computed with it."""
        ready = [(rid, job) for rid, job in self._streams.items() if self._stream_ready(job)]
        first = [(rid, job) for rid, job in ready if job.first_output is None]
        if self.in_flight is not None:
            # In flight, first pieces go ahead between short units of work: every stream goes in, first
            # ones first, so that each piece is started the step its input is there.
            ready = sorted(ready, key=lambda r: r[1].first_output is not None)[:budget]  # stable: oldest first
            pieces = self.in_flight.step([job.work for _, job in ready], self.config.max_batch_tokens)
            if len(ready) > 1:  # one batched call, as the batched hooks count
                self._batch_calls, self._batched_items = self._batch_calls + 1, self._batched_items + len(ready)
        else:
            ready = (first or ready)[:budget]
            pieces = self._run(self.model.next_output, self.model.next_outputs, [job.job for _, job in ready])
        now = time.monotonic()
        for (rid, job), result in zip(ready, pieces):
            if isinstance(result, Exception):
                del self._streams[rid]
                self._num_errors += 1
                out.finished.append(StageOutput(rid, self.name, prompt_token_ids=job.tokens, finished=True,
                                                finish_reason="error", error=self._error(rid, result)))
                continue
            piece, done = (None, False) if result is None else result
            if job.first_output is None and piece is not None:
                job.first_output = now
            if piece is not None:
                out.deltas.append(StageDelta(rid, self.name, finished=done, audio=piece.get("audio"),
                                             sampling_rate=piece.get("sampling_rate")))
            if done:
                del self._streams[rid]
                produced = (self.model.stream_result(job.job) if job.work is None
                            else self.in_flight.result(job.work))
                audio = produced.pop("audio", None)
                res = StageOutput(rid, self.name, prompt_token_ids=job.tokens, finished=True, finish_reason="stop",
                                  audio=None if audio is None else np.asarray(audio, dtype=np.float32),
                                  passthrough=produced,
                                  metrics={"ttft_s": job.first_output - job.arrival, "e2e_s": now - job.arrival})
                out.finished.append(res)
                self._latencies = (self._latencies + [now - job.arrival])[-1000:]
                self._num_finished += 1
        return len(ready)

    def tokenize(self, inp: StageInput, add_generation_prompt: bool = True, add_special_tokens: bool | None = None,
                 return_token_strs: bool = False) -> dict[str, Any]:
        raise RequestError(f"prompt: stage {self.name!r} takes codes, not text: it has nothing to tokenize",
                           stage=self.name, field="prompt")

    def detokenize(self, token_ids: list[int]) -> str:
        raise RequestError(f"tokens: stage {self.name!r} takes codes, not text: it has nothing to decode",
                           stage=self.name, field="tokens")

    def info(self) -> StageInfo:
        """The model's facts with its max_model_len."""
        return replace(self.model.info, max_model_len=self.model.max_model_len)

    # ---------------------------------------------------------------- stats
    def stats(self) -> StageStats:
        lat = sorted(self._latencies)
        return StageStats(
            stage=self.name,
            waiting=len(self._queue),
            running=len(self._streams),
            max_model_len=self.model.max_model_len,
            finished=self._num_finished,
            errors=self._num_errors,
            ttft_mean_s=(sum(lat) / len(lat)) if lat else None,
            ttft_p50_s=lat[len(lat) // 2] if lat else None,
            steps=self._num_steps,
            step_time_s=self._step_time,
            torch_threads=torch.get_num_threads(),
            # batched_items / batch_calls: the mean batch of the batched hooks.
            extra={**self.model.stats(), "batch_calls": self._batch_calls, "batched_items": self._batched_items,
                   **(self.in_flight.stats() if self.in_flight is not None else {})},
        )
