"""GenerationStageEngine: a non-autoregressive stage (e.g. token2wav), same interface as StageEngine.

No KV cache, no scheduler, no prefix caching: a request is one call of the stage model. The stage
model (`autoregressive = False`) implements two hooks:

    prepare_generation(inp: StageInput) -> job     validate at add time (raise ValueError)
    run_generation(job) -> dict                     {"audio": np.ndarray, ...} for one request

Requests run in arrival order, up to `max_num_seqs` per `step()`; a failing request fails alone.
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

from .sampling import SamplingParams
from .stage_model import StageModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class GenerationEngineConfig:
    name: str = "stage"
    model_path: str | Path = ""
    model_cls: type[StageModel] | None = None
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
    def __init__(self, config: GenerationEngineConfig, model: StageModel | None = None):
        self.config = config
        self.name = config.name
        if model is None:
            model = self._load_model(config)
        if getattr(model, "autoregressive", True):
            raise ValueError(f"stage {self.name}: {type(model).__name__} is autoregressive; use StageEngine")
        self.model = model
        self.tokenizer = getattr(model, "tokenizer", None)
        self._queue: OrderedDict[str, _Job] = OrderedDict()
        self._pending: list[StageOutput] = []
        self._num_finished = 0
        self._num_errors = 0
        self._num_steps = 0
        self._step_time = 0.0
        self._latencies: list[float] = []

    @classmethod
    def from_config(cls, stage: Any) -> "GenerationStageEngine":
        """Build from a user-facing `omni.config.StageConfig`."""
        from stages.checkpoints import resolve_model_path
        from stages.registry import resolve_stage_model

        sampling = stage.sampling if isinstance(stage.sampling, SamplingParams) else SamplingParams(**(stage.sampling or {}))
        cfg = GenerationEngineConfig(
            name=stage.name,
            model_path=resolve_model_path(stage.model_path),
            model_cls=resolve_stage_model(stage.model),
            max_num_seqs=stage.scheduler.max_num_seqs,
            default_sampling=sampling,
            dtype=stage.dtype,
            device=stage.device,
            model_kwargs=dict(stage.model_kwargs or {}),
        )
        return cls(cfg)

    @staticmethod
    def _load_model(config: GenerationEngineConfig) -> StageModel:
        if config.model_cls is None:
            raise ValueError(f"stage {config.name}: model: a generation stage needs a stage model class")
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if config.dtype not in _DTYPES:
            raise ValueError(f"stage {config.name}: dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
        return config.model_cls.load(Path(config.model_path), dtype=_DTYPES[config.dtype],
                                     device=torch.device(device), model_kwargs=config.model_kwargs)

    def _seed(self, inp: StageInput) -> int:
        sp = inp.sampling_params
        seed = sp.get("seed") if isinstance(sp, dict) else getattr(sp, "seed", None)
        if seed is None:
            seed = self.config.default_sampling.seed
        return int(seed or 0)

    # ------------------------------------------------------------- requests
    def add_request(self, inp: StageInput) -> None:
        rid = inp.request_id
        if rid in self._queue:
            raise ValueError(f"request_id {rid!r} is already in use on stage {self.name}")
        job = self.model.prepare_generation(inp, self._seed(inp))
        self._queue[rid] = _Job(inp, job, time.monotonic())

    def abort(self, request_id: str) -> None:
        job = self._queue.pop(request_id, None)
        if job is not None:
            self._pending.append(StageOutput(request_id, self.name, finished=True, finish_reason="abort",
                                             prompt_token_ids=list(job.inp.prompt_token_ids or [])))

    def has_unfinished(self) -> bool:
        return bool(self._queue) or bool(self._pending)

    # ----------------------------------------------------------------- step
    def step(self) -> list[StageOutput]:
        results, self._pending = self._pending, []
        t0 = time.perf_counter()
        ran = 0
        while self._queue and ran < max(1, self.config.max_num_seqs):
            rid, job = self._queue.popitem(last=False)
            ran += 1
            out = StageOutput(rid, self.name, prompt_token_ids=list(job.inp.prompt_token_ids or []), finished=True)
            try:
                produced = self.model.run_generation(job.job)
            except Exception as exc:  # one bad request never takes the stage down
                logger.exception("stage %s: request %s failed", self.name, rid)
                self._num_errors += 1
                out.finish_reason = "error"
                out.error = f"stage {self.name}: generation failed: {type(exc).__name__}: {exc}"
                results.append(out)
                continue
            audio = produced.pop("audio", None)
            out.audio = None if audio is None else np.asarray(audio, dtype=np.float32)
            out.passthrough = produced
            out.finish_reason = "stop"
            latency = time.monotonic() - job.arrival
            out.metrics = {"ttft_s": latency, "e2e_s": latency}
            self._latencies = (self._latencies + [latency])[-1000:]
            self._num_finished += 1
            results.append(out)
        if ran:
            self._num_steps += 1
            self._step_time += time.perf_counter() - t0
        return results

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        lat = sorted(self._latencies)
        return {
            "stage": self.name,
            "running": 0,
            "waiting": len(self._queue),
            "kv_usage": 0.0,
            "num_blocks": 0,
            "prefix_caching": False,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prefix_cache_hit_rate": 0.0,
            "preemptions": 0,
            "finished": self._num_finished,
            "errors": self._num_errors,
            "ttft_mean_s": (sum(lat) / len(lat)) if lat else None,
            "ttft_p50_s": lat[len(lat) // 2] if lat else None,
            "steps": self._num_steps,
            "step_time_s": self._step_time,
        }
