"""GenerationStageEngine: a one-shot stage (e.g. token2wav), same contract as StageEngine.

No KV cache, no prefix caching: a request is one call of the stage model (a
OneShotStageModel: `prepare_generation` when the request arrives, `run_generation`
when it runs). Requests run in arrival order, up to `max_num_seqs` per `step()`;
a failing request fails alone. The queue is this engine's scheduler: a request
lives in it from add_request until its step (or abort).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni.outputs import StageInput, StageOutput

from .interface import EngineStepOutput, StageStats
from .loading import load_stage_model
from .sampling_params import SamplingParams, resolve_sampling_params
from .stage_model import OneShotStageModel

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationEngineConfig:
    """Resolved configuration of one one-shot stage (built by omni.pipeline.engine_factory)."""

    name: str
    model_cls: type[OneShotStageModel]
    model_path: str | Path | None  # a local path (None when a loaded model is handed to the engine)
    max_num_seqs: int = 4  # requests run per step()
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    dtype: str = "float32"
    device: str = "auto"
    model_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Job:
    inp: StageInput
    job: Any
    arrival: float


class GenerationStageEngine:
    def __init__(self, config: GenerationEngineConfig, model: OneShotStageModel | None = None):
        self.config = config
        self.name = config.name
        if model is None:
            model = load_stage_model(config.name, config.model_cls, config.model_path, dtype=config.dtype,
                                     device=config.device, model_kwargs=config.model_kwargs)
        if getattr(model, "autoregressive", True):
            raise ValueError(f"stage {self.name}: {type(model).__name__} is autoregressive; use StageEngine")
        self.model = model
        self.tokenizer = model.tokenizer
        self._queue: OrderedDict[str, _Job] = OrderedDict()
        self._aborted: list[StageOutput] = []
        self._num_finished = 0
        self._num_errors = 0
        self._num_steps = 0
        self._step_time = 0.0
        self._latencies: list[float] = []

    # ------------------------------------------------------------- requests
    def add_request(self, inp: StageInput) -> None:
        rid = inp.request_id
        if rid in self._queue:
            raise ValueError(f"request_id {rid!r} is already in use on stage {self.name}")
        seed = resolve_sampling_params(inp.sampling_params, self.config.default_sampling).seed
        job = self.model.prepare_generation(inp, int(seed or 0))
        self._queue[rid] = _Job(inp, job, time.monotonic())

    def abort(self, request_id: str) -> None:
        job = self._queue.pop(request_id, None)
        if job is not None:
            self._aborted.append(StageOutput(request_id, self.name, finished=True, finish_reason="abort",
                                             prompt_token_ids=list(job.inp.prompt_token_ids or [])))

    def has_unfinished(self) -> bool:
        return bool(self._queue) or bool(self._aborted)

    def extend_request(self, request_id: str, token_ids: list[int], prompt_embeds: Any = None,
                       last: bool = False) -> None:
        # Config validation refuses streaming edges into one-shot stages; this guards direct callers.
        raise ValueError(f"stage {self.name!r} is a one-shot stage: its input cannot arrive in chunks "
                         "(use a non-streaming edge)")

    def read_rows(self, request_id: str, start: int, end: int) -> dict[str, Any]:
        raise ValueError(f"stage {self.name!r} is a one-shot stage: it has no per-token rows to read")

    def close(self) -> None:
        self._queue.clear()
        self._aborted.clear()

    # ----------------------------------------------------------------- step
    def step(self) -> EngineStepOutput:
        out = EngineStepOutput(aborted=self._aborted)
        self._aborted = []
        t0 = time.perf_counter()
        ran = 0
        while self._queue and ran < max(1, self.config.max_num_seqs):
            rid, job = self._queue.popitem(last=False)
            ran += 1
            res = StageOutput(rid, self.name, prompt_token_ids=list(job.inp.prompt_token_ids or []), finished=True)
            out.finished.append(res)
            try:
                produced = self.model.run_generation(job.job)
            except Exception as exc:  # one bad request never takes the stage down
                logger.exception("stage %s: request %s failed", self.name, rid)
                self._num_errors += 1
                res.finish_reason = "error"
                res.error = f"stage {self.name}: generation failed: {type(exc).__name__}: {exc}"
                continue
            audio = produced.pop("audio", None)
            res.audio = None if audio is None else np.asarray(audio, dtype=np.float32)
            res.passthrough = produced
            res.finish_reason = "stop"
            latency = time.monotonic() - job.arrival
            res.metrics = {"ttft_s": latency, "e2e_s": latency}
            self._latencies = (self._latencies + [latency])[-1000:]
            self._num_finished += 1
        if ran:
            self._num_steps += 1
            self._step_time += time.perf_counter() - t0
        return out

    # ---------------------------------------------------------------- stats
    def stats(self) -> StageStats:
        lat = sorted(self._latencies)
        return StageStats(
            stage=self.name,
            waiting=len(self._queue),
            max_model_len=self.model.max_model_len,
            finished=self._num_finished,
            errors=self._num_errors,
            ttft_mean_s=(sum(lat) / len(lat)) if lat else None,
            ttft_p50_s=lat[len(lat) // 2] if lat else None,
            steps=self._num_steps,
            step_time_s=self._step_time,
            torch_threads=torch.get_num_threads(),
            extra=self.model.stats(),
        )
