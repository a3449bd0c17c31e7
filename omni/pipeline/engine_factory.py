"""The engine factory: the one translation of a user's StageConfig into a running engine.

    StageConfig (pydantic, omni.config.schema)
        model          -> registry entry: autoregressive?  -> StageEngine | OneShotStageEngine
                       -> the model class (imported here, in the process that runs the stage)
        model_path     -> registry path schemes (builtin:NAME) or a local path
        cache / scheduler / sampling / dtype / device / ...  -> the engine's resolved config

Both backends build engines here (the Ray backend inside each stage actor). A custom
`engine_factory` (StageConfig -> Engine) replaces `build_engine`, e.g. with a test double.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni import registry
from omni.config.schema import StageConfig
from omni.engine.interface import Engine
from omni.errors import ConfigError, StageStartError

EngineFactory = Callable[[StageConfig], Engine]


def build_engine(stage: StageConfig, *, emit_hidden_states: bool = True, cuda_graphs: bool = True) -> Engine:
    """The engine of `stage`: the class the registry entry calls for, configured from `stage`.

    Two engine settings no YAML field carries, left at their defaults by the pipeline (which asks for
    rows per request) and set by the engine benchmarks (omni/bench/engine_loop.py):
    `emit_hidden_states` (hand every request's per-token rows out unless it says otherwise) and
    `cuda_graphs` (False: always eager); a one-shot engine has neither."""
    entry = registry.stage_model_entry(stage.model)
    model_cls = registry.resolve_stage_model(stage.model)
    model_path = registry.resolve_model_path(stage.model_path)
    if not entry.info.autoregressive:
        from omni.engine.one_shot import OneShotEngineConfig, OneShotStageEngine

        model_kwargs = dict(stage.model_kwargs)
        threads = one_shot_threads(model_kwargs)
        return OneShotStageEngine(OneShotEngineConfig(
            name=stage.name, model_cls=model_cls, model_path=model_path,
            max_num_seqs=stage.scheduler.max_num_seqs, max_batch_tokens=stage.scheduler.max_num_batched_tokens,
            default_sampling=stage.sampling,
            dtype=stage.dtype, device=stage.device, model_kwargs=model_kwargs, **threads))

    from omni.engine.engine import StageEngine
    from omni.engine.engine_config import StageEngineConfig
    from omni.engine.core.scheduler import SchedulerSettings

    if stage.cache.memory_budget_mb == "auto":  # Omni resolves it (omni/planning/) before any engine is built
        raise ConfigError(f"stage {stage.name!r}: cache.memory_budget_mb: 'auto' takes the memory plan's number, "
                          "and this config was not planned (build it through Omni, or plan it with "
                          "omni.planning.plan.planned_config first)", stage=stage.name, field="cache.memory_budget_mb")

    return StageEngine(StageEngineConfig(
        name=stage.name, model_cls=model_cls, model_path=model_path,
        tokenizer_path=registry.resolve_model_path(stage.tokenizer, "tokenizer path") if stage.tokenizer else None,
        enable_prefix_caching=stage.enable_prefix_caching,
        block_size=stage.cache.block_size, num_blocks=stage.cache.num_blocks,
        memory_budget_mb=stage.cache.memory_budget_mb, hash_seed=stage.cache.hash_seed,
        scheduler=SchedulerSettings(max_num_seqs=stage.scheduler.max_num_seqs,
                                    max_num_batched_tokens=stage.scheduler.max_num_batched_tokens,
                                    enable_chunked_prefill=stage.scheduler.enable_chunked_prefill),
        max_model_len=stage.scheduler.max_model_len,
        default_sampling=stage.sampling, use_chat_template=stage.use_chat_template,
        dtype=stage.dtype, device=stage.device, model_kwargs=dict(stage.model_kwargs),
        emit_hidden_states=emit_hidden_states, cuda_graphs=cuda_graphs, takes_caller_prompt=not stage.inputs))


def one_shot_threads(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop a one-shot stage's worker thread options out of its model_kwargs (the keys users write for
    token2wav): OneShotEngineConfig's finish_thread / compute_threads (ValueError naming the key)."""
    options: dict[str, Any] = {}
    if "vocoder_thread" in model_kwargs:
        value = model_kwargs.pop("vocoder_thread")
        if not isinstance(value, bool):
            raise ValueError(f"model_kwargs.vocoder_thread: must be true or false, got {value!r}")
        options["finish_thread"] = value
    if "dit_threads" in model_kwargs:
        value = model_kwargs.pop("dit_threads")
        if isinstance(value, bool) or not isinstance(value, int) or value not in (1, 2):
            raise ValueError(f"model_kwargs.dit_threads: must be 1 or 2, got {value!r}")
        options["compute_threads"] = value
    return options


def start_error(stage: str, e: BaseException) -> StageStartError:
    """`e` as a StageStartError naming `stage` once (an engine's own errors already say
    "stage NAME: ..."; the prefix is not repeated)."""
    if isinstance(e, StageStartError):
        return e
    msg = str(e)
    for prefix in (f"stage {stage!r}: ", f"stage {stage}: "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
            break
    return StageStartError(f"stage {stage!r} failed to start: {type(e).__name__}: {msg}", stage=stage)


def make_engine(stage: StageConfig, engine_factory: EngineFactory | None = None) -> Engine:
    """Build the engine of `stage`; any failure is a StageStartError naming the stage."""
    try:
        return (engine_factory or build_engine)(stage)
    except Exception as e:
        raise start_error(stage.name, e) from e
