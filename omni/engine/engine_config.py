"""StageEngineConfig: one autoregressive stage's resolved configuration, and the KV cache size and
max_model_len it gives.

omni.pipeline.engine_factory translates the user's omni.config.schema.StageConfig into it; tests and
benchmarks may build one directly. Apart from the engine loop so that what a config means (its defaults,
its cache size) reads in one place.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni.sampling_params import SamplingParams

from omni.engine.core.scheduler import SchedulerSettings
from omni.engine.runner.model_runner import ModelRunner
from omni.engine.stage_model import AutoregressiveStageModel

logger = logging.getLogger(__name__)

# Keep the KV cache from defaulting to more blocks than the scheduler could
# ever fill (tiny models would otherwise get millions of blocks).
_DEFAULT_MEMORY_BUDGET_MB = 1024.0


@dataclass(slots=True)
class StageEngineConfig:
    """Resolved configuration of one autoregressive stage."""

    name: str
    model_cls: type[AutoregressiveStageModel]
    model_path: str | Path | None  # a local path (None when a loaded model is handed to the engine)
    tokenizer_path: str | Path | None = None
    enable_prefix_caching: bool = True
    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_mb: float | None = None
    hash_seed: int = 0
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    # None: the model's maximum. Either way at most what the KV cache holds.
    max_model_len: int | None = None
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    use_chat_template: bool = False
    dtype: str = "float32"
    device: str = "auto"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    attention_backend: str | None = None
    # Hand every request's per-token rows (hidden states, discovered outputs) out with its
    # output. A request can say otherwise (StageInput.return_hidden_states); the pipeline
    # always does, from the stage graph (rows only where a downstream stage reads them)
    # and from the caller's return_hidden_states.
    emit_hidden_states: bool = True
    # Capture decode steps in CUDA graphs (CUDA + Triton attention + a model
    # that supports it); False = always eager (vLLM's enforce_eager).
    cuda_graphs: bool = True
    # The stage's prompts are the caller's (a pipeline's entry stage), not made by the pipeline from upstream
    # stages' outputs: SamplingParams.truncate_prompt_tokens cuts only those.
    takes_caller_prompt: bool = True


def _num_kv_blocks(config: StageEngineConfig, model: AutoregressiveStageModel, max_len: int) -> int:
    """The KV cache's blocks: the config's num_blocks, else what cache.memory_budget_mb holds; with neither, enough
    for max_num_seqs sequences of max_len within the default budget."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = ModelRunner.kv_bytes_per_block(model, config.block_size)
    budget = config.memory_budget_mb or _DEFAULT_MEMORY_BUDGET_MB
    by_budget = int(budget * 2**20 // per_block)
    if config.memory_budget_mb is None:
        needed = -(-config.scheduler.max_num_seqs * max_len // config.block_size) + 1
        by_budget = min(by_budget, needed)
    if by_budget < 2:
        raise ValueError(
            f"stage {config.name}: cache.memory_budget_mb={budget} holds {by_budget} blocks of "
            f"{per_block} bytes; at least 2 are needed")
    return by_budget


@dataclass(frozen=True, slots=True)
class CacheSize:
    num_blocks: int
    max_model_len: int  # at most what the KV cache holds
    max_len_note: str = ""  # why max_model_len is lower than configured ("" when it is not)


def cache_size(config: StageEngineConfig, model: AutoregressiveStageModel) -> CacheSize:
    """The KV cache's blocks and the max_model_len they allow: the config's value, else the model's maximum, and
    at most what the cache holds (a sequence the cache cannot hold would wait forever, and block the queue behind
    it), lowered with a warning."""
    max_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
    num_blocks = _num_kv_blocks(config, model, max_len)
    capacity = num_blocks * config.block_size
    if max_len <= capacity:
        return CacheSize(num_blocks, max_len)
    logger.warning("stage %s: the KV cache holds %d tokens (%d blocks of %d), fewer than max_model_len "
                   "%d; max_model_len is lowered to %d (raise cache.num_blocks or cache.memory_budget_mb "
                   "to keep it)", config.name, capacity, num_blocks, config.block_size, max_len, capacity)
    return CacheSize(num_blocks, capacity, f" (lowered from {max_len}: the KV cache holds {num_blocks} blocks of "
                                           f"{config.block_size} tokens)")
