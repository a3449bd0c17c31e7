"""StageEngine: one stage, in one process. No Ray import here.

add_request -> queued Request; step() = schedule -> forward -> tensor-cache
write -> gather hit rows for new requests -> scheduler update -> StageOutputs
of the requests that finished.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from omni.outputs import StageInput, StageOutput

from .kv_cache import KVCacheManager
from .request import Request, RequestStatus
from .model_runner import ModelRunner, RunnerRequestState
from .sampling import SamplingParams, make_generator
from .scheduler import Scheduler, SchedulerConfig
from .stage_model import StageModel
from .output_rows import FinishedRows, OutputRows, RowsRequest
from .tensor_cache import StageTensorCache

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
# Keep the KV cache from defaulting to more blocks than the scheduler could
# ever fill (tiny models would otherwise get millions of blocks).
_DEFAULT_MEMORY_BUDGET_MB = 1024.0


@dataclass(slots=True)
class StageEngineConfig:
    """Internal, resolved configuration of one stage (see omni.config for the user-facing one)."""

    name: str = "stage"
    model_path: str | Path = ""
    model_cls: type[StageModel] | None = None  # None -> stages.causal_lm.CausalLMStage
    tokenizer_path: str | Path | None = None
    enable_prefix_caching: bool = True
    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_mb: float | None = None
    hash_seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    use_chat_template: bool = False
    dtype: str = "float32"
    device: str = "auto"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    attention_backend: str | None = None
    # Hand hidden states / discovered outputs downstream. Off for a leaf stage
    # whose caller only wants text: no per-token rows are kept at all.
    emit_hidden_states: bool = True
    # Capture decode steps in CUDA graphs (CUDA + Triton attention + a model
    # that supports it); False = always eager (vLLM's enforce_eager).
    cuda_graphs: bool = True


class StageEngine:
    def __init__(self, config: StageEngineConfig, model: StageModel | None = None):
        self.config = config
        self.name = config.name
        if model is None:
            model = self._load_model(config)
        self.model = model
        self.tokenizer = getattr(model, "tokenizer", None)
        max_len = config.max_model_len or config.scheduler.max_model_len or model.max_model_len
        max_len = min(max_len, model.max_model_len)
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=max_len,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
        )
        if not sched_cfg.enable_chunked_prefill and sched_cfg.max_num_batched_tokens < max_len:
            raise ValueError(
                f"stage {self.name}: max_num_batched_tokens ({sched_cfg.max_num_batched_tokens}) must be "
                f">= max_model_len ({max_len}) when chunked prefill is disabled")
        self.max_model_len = max_len
        num_blocks = self._num_blocks(config, model, sched_cfg)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, config.hash_seed)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        self.runner = ModelRunner(
            model, num_blocks, config.block_size, config.attention_backend,
            max_num_tokens=sched_cfg.max_num_batched_tokens, max_num_seqs=sched_cfg.max_num_seqs,
            max_model_len=max_len, cuda_graphs=config.cuda_graphs, emit_rows=config.emit_hidden_states)
        # Rows of every computed token, on the KV slot mapping. With prefix
        # caching on, this store is the stage tensor cache (hits read rows
        # other requests wrote); off, the same layout is private per request.
        store = StageTensorCache(num_blocks, config.block_size) if config.emit_hidden_states else None
        self.tensor_cache = store if config.enable_prefix_caching else None
        # Per-token outputs handed downstream; None for a stage whose caller wants text only.
        # On a GPU their host-side bookkeeping runs on a background thread (output_rows.py).
        self.rows = (OutputRows(store, background=torch.device(model.device).type == "cuda")
                     if store is not None else None)
        self._pending: list[StageOutput] = []  # aborted requests, reported by the next step()
        self._ttfts: list[float] = []
        self._num_finished = 0
        self._num_errors = 0
        self._step_time = 0.0
        self._num_steps = 0

    # ------------------------------------------------------------- creation
    @classmethod
    def from_config(cls, stage: Any) -> "StageEngine":
        """Build from a user-facing `omni.config.StageConfig`."""
        from stages.checkpoints import resolve_model_path
        from stages.registry import resolve_stage_model

        model_cls = resolve_stage_model(stage.model)
        if not getattr(model_cls, "autoregressive", True):
            # Generation stages (e.g. token2wav): no KV cache, no scheduler steps.
            from .generation_engine import GenerationStageEngine

            return GenerationStageEngine.from_config(stage)
        sampling = stage.sampling if isinstance(stage.sampling, SamplingParams) else SamplingParams(**(stage.sampling or {}))
        cfg = StageEngineConfig(
            name=stage.name,
            model_path=resolve_model_path(stage.model_path),
            model_cls=model_cls,
            tokenizer_path=resolve_model_path(stage.tokenizer) if stage.tokenizer else None,
            enable_prefix_caching=stage.enable_prefix_caching,
            block_size=stage.cache.block_size,
            num_blocks=stage.cache.num_blocks,
            memory_budget_mb=stage.cache.memory_budget_mb,
            hash_seed=stage.cache.hash_seed,
            scheduler=SchedulerConfig(
                max_num_seqs=stage.scheduler.max_num_seqs,
                max_num_batched_tokens=stage.scheduler.max_num_batched_tokens,
                max_model_len=stage.scheduler.max_model_len or 0,
                enable_chunked_prefill=stage.scheduler.enable_chunked_prefill,
            ),
            max_model_len=stage.scheduler.max_model_len,
            default_sampling=sampling,
            use_chat_template=stage.use_chat_template,
            dtype=stage.dtype,
            device=stage.device,
            model_kwargs=dict(stage.model_kwargs or {}),
        )
        return cls(cfg)

    @staticmethod
    def _load_model(config: StageEngineConfig) -> StageModel:
        model_cls = config.model_cls
        if model_cls is None:
            from stages.causal_lm import CausalLMStage

            model_cls = CausalLMStage
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if config.dtype not in _DTYPES:
            raise ValueError(f"stage {config.name}: dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
        return model_cls.load(
            Path(config.model_path), dtype=_DTYPES[config.dtype], device=torch.device(device),
            model_kwargs=config.model_kwargs,
            tokenizer_path=Path(config.tokenizer_path) if config.tokenizer_path else None,
        )

    @staticmethod
    def _num_blocks(config: StageEngineConfig, model: StageModel, sched: SchedulerConfig) -> int:
        if config.num_blocks is not None:
            return config.num_blocks
        per_block = ModelRunner.kv_bytes_per_block(model, config.block_size)
        budget = config.memory_budget_mb or _DEFAULT_MEMORY_BUDGET_MB
        by_budget = int(budget * 2**20 // per_block)
        if config.memory_budget_mb is None:
            needed = -(-sched.max_num_seqs * sched.max_model_len // config.block_size) + 1
            by_budget = min(by_budget, needed)
        if by_budget < 2:
            raise ValueError(
                f"stage {config.name}: cache.memory_budget_mb={budget} holds {by_budget} blocks of "
                f"{per_block} bytes; at least 2 are needed")
        return by_budget

    # ------------------------------------------------------------- requests
    def _sampling_params(self, value: Any) -> SamplingParams:
        if value is None:
            return self.config.default_sampling
        if isinstance(value, SamplingParams):
            return value
        if isinstance(value, dict):
            return SamplingParams(**{**self.config.default_sampling.model_dump(), **value})
        raise ValueError(f"sampling_params must be a SamplingParams or a dict, got {type(value).__name__}")

    def _tokenize(self, inp: StageInput) -> list[int]:
        if inp.prompt_token_ids is not None:
            return [int(t) for t in inp.prompt_token_ids]
        if inp.prompt is None:
            if inp.prompt_embeds is not None:
                # Embeddings-only prompt: placeholder ids; the embeddings digest
                # in the block hashes keeps such prompts apart in the cache.
                return [0] * int(np.asarray(inp.prompt_embeds).shape[0])
            raise ValueError("prompt: a request needs `prompt`, `prompt_token_ids` or `prompt_embeds`")
        if self.tokenizer is None:
            raise ValueError(f"prompt: stage {self.name} has no tokenizer; send prompt_token_ids instead")
        if isinstance(inp.prompt, list):
            messages = inp.prompt
        elif self.config.use_chat_template:
            messages = [{"role": "user", "content": inp.prompt}]
        else:
            return list(self.tokenizer(inp.prompt, add_special_tokens=True)["input_ids"])
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def add_request(self, inp: StageInput) -> None:
        """Queue one request; raises ValueError naming the bad field (the stage keeps serving)."""
        rid = inp.request_id
        if rid in self.scheduler.requests:
            raise ValueError(f"request_id {rid!r} is already in use on stage {self.name}")
        params = self._sampling_params(inp.sampling_params)
        prepared = self.model.preprocess(inp)
        token_ids = prepared.token_ids if prepared is not None else self._tokenize(inp)
        prompt_embeds = prepared.prompt_embeds if prepared is not None else inp.prompt_embeds
        if not token_ids:
            raise ValueError("prompt: the prompt is empty (0 tokens)")
        vocab = self.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is out of vocabulary (allowed 0..{vocab - 1})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens, must be shorter than max_model_len ({self.max_model_len}) "
                "to leave room for at least one generated token")
        embeds, digests = None, None
        if prompt_embeds is not None:
            embeds, digests = self._prompt_embeds(prompt_embeds, len(token_ids))
        req = Request(
            rid, token_ids, sampling_params=params, cache_salt=inp.cache_salt,
            mm_features=prepared.mm_features if prepared is not None else (),
            prompt_embeds_digests=digests, block_hasher=self.kv.block_hasher,
            arrival_time=time.monotonic(), eos_token_id=self.model.eos_token_id,
        )
        self.model.add_request(rid, prepared, inp)
        self.runner.add_request(RunnerRequestState(req, embeds, make_generator(params)))
        self.scheduler.add_request(req)
        if self.rows is not None:
            self.rows.add(rid)

    def _prompt_embeds(self, value: Any, num_tokens: int) -> tuple[torch.Tensor, list[bytes]]:
        arr = np.ascontiguousarray(np.asarray(value, dtype=np.float32))
        width = self.model.prompt_embed_size or self.model.hidden_size
        if arr.ndim != 2 or arr.shape != (num_tokens, width):
            raise ValueError(f"prompt_embeds: expected shape ({num_tokens}, {width}), got {arr.shape}")
        bs = self.config.block_size
        # One digest per block of rows: the block hashes chain them, so equal
        # leading embeddings still share blocks across turns.
        digests = [xxhash.xxh3_128_digest(arr[i : i + bs].tobytes()) for i in range(0, num_tokens, bs)]
        t = torch.from_numpy(arr).to(device=self.model.device, dtype=self.model.dtype)
        return t, digests

    def abort(self, request_id: str) -> None:
        req = self.scheduler.abort(request_id)
        had_rows = self.rows is not None and self.rows.drop(request_id)
        if req is not None or had_rows:
            self.runner.remove_request(request_id)
            self.model.remove_request(request_id)
            out = StageOutput(request_id, self.name, finished=True, finish_reason="abort")
            if req is not None:
                out.prompt_token_ids = list(req.prompt_token_ids)
                out.token_ids = list(req.output_token_ids)
            self._pending.append(out)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ----------------------------------------------------------------- step
    def step(self) -> list[StageOutput]:
        results, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.runner.execute(sched)  # drops state of finished requests
            return results
        t0 = time.perf_counter()
        try:
            out = self.runner.execute(sched)
        except Exception as exc:  # a failing batch fails its requests, not the stage
            logger.exception("stage %s: forward pass failed", self.name)
            for s in sched.scheduled:
                req = self.scheduler.fail(s.req_id)
                if self.rows is not None:
                    self.rows.drop(s.req_id)
                self.runner.remove_request(s.req_id)
                self.model.remove_request(s.req_id)
                self._num_errors += 1
                results.append(StageOutput(
                    s.req_id, self.name, prompt_token_ids=list(req.prompt_token_ids) if req else [],
                    finished=True, finish_reason="error",
                    error=f"stage {self.name}: forward pass failed: {type(exc).__name__}: {exc}"))
            return results
        if self.rows is not None:
            self.rows.collect(out.row_ranges, out.rows, out.other_outputs, out.slot_mapping)
        elif out.rows is not None:
            out.rows.release()
        finished = self.scheduler.update(sched, out.sampled)
        rows = {}
        if finished and self.rows is not None:
            # Block tables as scheduled this step: update() has already freed them.
            tables = {s.req_id: s.block_ids for s in sched.scheduled}
            rows = self.rows.finish([RowsRequest(r.request_id, tables[r.request_id], r.num_computed_tokens,
                                                 max(r.num_cached_tokens, 0)) for r in finished])
        for req in finished:
            results.append(self._make_output(req, rows.get(req.request_id)))
        self._step_time += time.perf_counter() - t0
        self._num_steps += 1
        return results

    def _make_output(self, req: Request, rows: FinishedRows | None = None) -> StageOutput:
        rid = req.request_id
        self.runner.remove_request(rid)
        self.model.remove_request(rid)
        ttft = (req.first_token_time - req.arrival_time) if req.first_token_time else None
        self._num_finished += 1
        if ttft is not None:
            self._ttfts.append(ttft)
            del self._ttfts[:-1000]
        out = StageOutput(
            rid, self.name,
            prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids),
            finished=True,
            finish_reason=_FINISH_REASONS.get(req.status, "stop"),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics={"ttft_s": ttft or 0.0, "e2e_s": time.monotonic() - req.arrival_time},
        )
        if self.tokenizer is not None:
            out.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        if rows is not None:
            out.hidden_states, out.mm_outputs, out.passthrough = rows.hidden_states, rows.mm_outputs, rows.passthrough
        return out

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        kv = self.kv.stats()
        ttfts = sorted(self._ttfts)
        s = {
            "stage": self.name,
            "device": str(self.model.device),
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_usage": self.kv.usage,
            "num_blocks": self.kv.num_blocks,
            "prefix_caching": self.config.enable_prefix_caching,
            "prefix_cache_queries": kv.get("queries", 0),
            "prefix_cache_hits": kv.get("hits", 0),
            "prefix_cache_hit_rate": kv.get("hit_rate", 0.0),
            "preemptions": self.scheduler.num_preemptions,
            "finished": self._num_finished,
            "errors": self._num_errors,
            "ttft_mean_s": (sum(ttfts) / len(ttfts)) if ttfts else None,
            "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
            "steps": self._num_steps,
            "step_time_s": self._step_time,
            "tensor_cache_time_s": self.rows.time_s if self.rows is not None else 0.0,
            "tensor_cache_worker_time_s": self.rows.worker_time_s if self.rows is not None else 0.0,
            "tensor_cache_write_time_s": self.rows.write_time_s if self.rows is not None else 0.0,
            "rows_deliver_time_s": self.rows.deliver_time_s if self.rows is not None else 0.0,
            "rows_delivered": self.rows.rows_delivered if self.rows is not None else 0,
        }
        s.update(self.runner.stats())
        if self.tensor_cache is not None:
            s.update(self.tensor_cache.stats())
        s.update(self.model.stats())
        return s
