"""The engine factory: one translation from a StageConfig to an engine, the class picked by the registry."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni.config.schema import SchedulerConfig
from omni.config.loader import load_config
from omni.engine.engine import StageEngine
from omni.engine.one_shot import OneShotStageEngine
from omni.engine.core.scheduler import SchedulerSettings
from omni.engine.stage_model import OneShotStageModel
from omni.errors import StageStartError
from omni.pipeline.engine_factory import build_engine, make_engine
from omni.registry import register_stage_model, resolve_model_path
from stages.causal_lm import CausalLMStage

REPO = Path(__file__).resolve().parents[2]


class EchoOneShot(OneShotStageModel):
    """A one-shot stage model that needs no weights."""

    max_model_len = 8

    @classmethod
    def load(cls, model_path, *, dtype, device, model_kwargs=None, tokenizer_path=None):
        stage = cls()
        stage.device, stage.dtype, stage.loaded_from = device, dtype, model_path
        return stage

    def prepare_generation(self, inp, seed):
        return list(inp.prompt_token_ids or [])

    def run_generation(self, job):
        return {"echo": job}


register_stage_model("echo_one_shot", "tests.pipeline.test_engine_factory:EchoOneShot",
                     info="tests.pipeline.test_engine_factory:EchoOneShot.info")


def test_engine_side_defaults_are_the_config_defaults():
    user = SchedulerConfig()
    assert SchedulerSettings() == SchedulerSettings(user.max_num_seqs, user.max_num_batched_tokens,
                                                    user.enable_chunked_prefill)


def test_autoregressive_stage_gets_a_stage_engine_configured_from_its_stage_config():
    thinker = load_config(REPO / "stage_configs" / "tiny_chain.yaml").stage("thinker")
    engine = build_engine(thinker)
    assert isinstance(engine, StageEngine) and engine.name == "thinker"
    cfg = engine.config
    assert cfg.model_cls is CausalLMStage and cfg.model_path == resolve_model_path("builtin:tiny-qwen2")
    assert (cfg.block_size, cfg.num_blocks, cfg.enable_prefix_caching) == (4, 256, True)
    assert cfg.scheduler == SchedulerSettings(max_num_seqs=16, max_num_batched_tokens=256)
    assert cfg.max_model_len == engine.max_model_len == 256
    assert cfg.default_sampling == thinker.sampling and cfg.default_sampling.max_tokens == 8


def test_one_shot_stage_gets_a_one_shot_engine(tmp_path):
    data = {"stages": [{"name": "echo", "model": "echo_one_shot", "model_path": str(tmp_path),
                        "enable_prefix_caching": False, "final_output": "tokens",
                        "scheduler": {"max_num_seqs": 3}, "sampling": {"seed": 5}}]}
    engine = build_engine(load_config(data).stages[0])
    assert isinstance(engine, OneShotStageEngine)
    assert engine.config.max_num_seqs == 3 and engine.config.default_sampling.seed == 5
    assert engine.model.loaded_from == tmp_path.resolve() and engine.model.dtype == torch.float32


def test_a_failure_to_build_names_the_stage(tmp_path):
    data = {"stages": [{"name": "lost", "model_path": str(tmp_path / "nowhere"), "final_output": "text"}]}
    with pytest.raises(StageStartError, match="stage 'lost' failed to start: ValueError: model path '.*nowhere' "
                                              "does not exist"):
        make_engine(load_config(data).stages[0])


@pytest.mark.parametrize("inner", ["stage 'lost': dtype must be one of ['float32'], got 'fp8'",
                                   "stage lost: dtype must be one of ['float32'], got 'fp8'"])
def test_a_start_error_names_the_stage_once(tmp_path, inner):
    """An engine error that already says which stage is not prefixed with the stage again."""
    data = {"stages": [{"name": "lost", "model_path": str(tmp_path), "final_output": "text"}]}

    def factory(stage):
        raise ValueError(inner)

    with pytest.raises(StageStartError) as ei:
        make_engine(load_config(data).stages[0], factory)
    assert str(ei.value) == "stage 'lost' failed to start: ValueError: dtype must be one of ['float32'], got 'fp8'"
    assert ei.value.stage == "lost"
