"""Checkpoints without weights (`builtin:qwen2_5-omni-7b-shapes`): the 7B model's layout, each part made at random on
its stage's device as it loads, so that the 7B pipeline's GPU cost can be measured where its weights cannot be had.
Here on the CPU: the 7B layout's parameter count (on the meta device), and the whole tiny pipeline from a copy of the
tiny checkpoint without its weights."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from omni import Omni
from stages.common.parts import MARKER, random_weights_seed
from stages.qwen2_5_omni.checkpoint import omni_7b_shapes_config
from stages.qwen2_5_omni.loading import load_omni_part

REPO = Path(__file__).resolve().parents[2]


def test_the_7b_layout_has_the_7b_models_parameters():
    from transformers import Qwen2_5OmniForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5OmniForConditionalGeneration(omni_7b_shapes_config())
    count = {part: sum(p.numel() for p in getattr(model, part).parameters())
             for part in ("thinker", "talker", "token2wav")}
    # Qwen/Qwen2.5-Omni-7B: 10.7 B parameters in all (22.4 GB of bf16 safetensors, some of it fp32)
    assert 8.5e9 < count["thinker"] < 9.2e9  # the 7.6 B Qwen2.5-7B decoder, the 0.67 B vision and 0.64 B audio encoders
    assert 1.0e9 < count["talker"] < 1.5e9
    assert 0.1e9 < count["token2wav"] < 0.5e9
    assert 1.04e10 < sum(count.values()) < 1.1e10


@pytest.fixture(scope="module")
def weightless(tiny_omni, tmp_path_factory):
    """The tiny checkpoint's config, speakers and tokenizer, without its weights."""
    path = tmp_path_factory.mktemp("weightless") / "tiny-qwen2_5-omni"
    shutil.copytree(tiny_omni, path, ignore=shutil.ignore_patterns("*.safetensors*"))
    marker = json.loads((path / MARKER).read_text())
    (path / MARKER).write_text(json.dumps({**marker, "random_weights": {"seed": 7}}))
    return path


def test_a_part_is_made_from_its_seed_in_the_checkpoints_shapes(tiny_omni, weightless):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Thinker

    assert random_weights_seed(weightless) == 7 and random_weights_seed(tiny_omni) is None
    real, _ = load_omni_part(tiny_omni, "thinker", Thinker, torch.float32, torch.device("cpu"))
    made, _ = load_omni_part(weightless, "thinker", Thinker, torch.float32, torch.device("cpu"))
    again, _ = load_omni_part(weightless, "thinker", Thinker, torch.float32, torch.device("cpu"))
    real_params, made_params = dict(real.named_parameters()), dict(made.named_parameters())
    assert {k: v.shape for k, v in made_params.items()} == {k: v.shape for k, v in real_params.items()}
    for name, p in again.named_parameters():
        assert torch.equal(p, made_params[name]), name  # the seed decides every weight
    weight = "model.language_model.layers.0.mlp.up_proj.weight"
    key = weight if weight in made_params else weight.replace("language_model.", "")
    assert not torch.equal(made_params[key], real_params[key])


@pytest.mark.slow
def test_the_pipeline_runs_end_to_end_without_weights(weightless):
    over = {name: {"model_path": str(weightless)} for name in ("thinker", "talker", "token2wav")}
    over["thinker"]["sampling"] = {"temperature": 0.0, "max_tokens": 6, "min_tokens": 6}
    over["talker"]["sampling"] = {"temperature": 0.0, "max_tokens": 20, "min_tokens": 20}
    with Omni(str(REPO / "stage_configs" / "qwen2_5_omni_tiny.yaml"), backend="local", stage_overrides=over) as o:
        [out] = o.generate(["Say something."], use_tqdm=False)
    assert len(out.outputs["thinker"].token_ids) == 6
    audio = out.outputs["token2wav"].audio
    assert audio.size > 0 and np.isfinite(audio).all()
