"""Shared helpers for engine-level tests."""
from __future__ import annotations

from omni.engine.engine import StageEngine
from omni.engine.engine_config import StageEngineConfig
from omni.sampling_params import SamplingParams
from omni.engine.core.scheduler import SchedulerSettings
from omni.messages import StageInput, StageOutput
from stages.causal_lm import CausalLMStage

GREEDY = dict(temperature=0.0)


def make_engine(model_path, *, model=None, caching=True, num_blocks=256, block_size=4,
                max_num_batched_tokens=512, max_num_seqs=16, **kw) -> StageEngine:
    cfg = StageEngineConfig(
        name=kw.pop("name", "test"),
        model_cls=type(model) if model is not None else CausalLMStage,
        model_path=model_path,
        enable_prefix_caching=caching,
        block_size=block_size,
        num_blocks=num_blocks,
        scheduler=SchedulerSettings(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        **kw,
    )
    return StageEngine(cfg, model=model)


def run_to_completion(engine: StageEngine, max_steps: int = 10_000) -> dict[str, StageOutput]:
    outs: dict[str, StageOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        step = engine.step()
        for o in step.aborted + step.finished:
            outs[o.request_id] = o
        engine.kv.check_integrity()
    assert not engine.has_unfinished(), "engine did not finish within max_steps"
    return outs


def generate(engine: StageEngine, prompts: list[list[int]], prefix: str = "r", **params) -> list[StageOutput]:
    sp = SamplingParams(**{**GREEDY, **params})
    for i, p in enumerate(prompts):
        engine.add_request(StageInput(f"{prefix}{i}", prompt_token_ids=p, sampling_params=sp))
    outs = run_to_completion(engine)
    return [outs[f"{prefix}{i}"] for i in range(len(prompts))]


def assert_no_leak(engine: StageEngine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "blocks leaked"
    assert not engine.runner.states and len(engine.rows) == 0


def run_one(engine: StageEngine, rid: str, prompt: list[int], stream: bool = False, **params) -> tuple[StageOutput, list]:
    """One request through the engine alone: its output (no error) and the deltas it streamed."""
    engine.add_request(StageInput(rid, prompt_token_ids=list(prompt), stream=stream, sampling_params=params))
    deltas = []
    while engine.has_unfinished():
        step = engine.step()
        deltas += [d for d in step.deltas if d.request_id == rid]
        for o in step.finished:
            if o.request_id == rid:
                assert o.error is None, o.error
                return o, deltas
    raise AssertionError(f"no output for {rid}")
