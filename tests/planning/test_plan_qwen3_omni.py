"""`omni plan` on the Qwen3-Omni pipeline: each stage's weights from its own prefix of the shared checkpoint, and
a profile step for every stage (the talker and code2wav take their inputs from their own `profile_inputs`)."""
import json

import pytest

from omni import cli
from omni.planning.weights import checkpoint_weights

CONFIG = "stage_configs/qwen3_omni_tiny.yaml"


def test_the_qwen3_checkpoint_is_split_by_stage_prefix():
    from stages.qwen3_omni.edges import Qwen3OmniCode2WavStage, Qwen3OmniTalkerStage, Qwen3OmniThinkerStage
    from stages.qwen3_omni.checkpoint import tiny_qwen3_omni_checkpoint

    path = tiny_qwen3_omni_checkpoint("tiny")
    whole = checkpoint_weights(path, 4).bytes
    prefixes = [cls.checkpoint_prefix for cls in (Qwen3OmniThinkerStage, Qwen3OmniTalkerStage, Qwen3OmniCode2WavStage)]
    assert prefixes == ["thinker.", "talker.", "code2wav."]
    parts = [checkpoint_weights(path, 4, p).bytes for p in prefixes]
    assert all(parts) and sum(parts) == whole


@pytest.mark.slow
def test_plan_profiles_every_qwen3_stage(store, capsys):
    rc = cli.main(["plan", CONFIG, "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["fits"], out
    for name in ("thinker", "talker", "code2wav"):
        stage = out["stages"][name]
        # measured by a profile step (a talker or code2wav fed the default token-id inputs fails it and is estimated)
        assert stage["activations_source"] == "measured by omni plan", (name, stage)
        # (code2wav's host peak over its warm-up request's can be 0 on a CPU: it allocates nothing new)
        assert stage["activations_bytes"] >= 0, name
        assert stage["weights_source"] == "safetensors headers", name
    assert out["stages"]["thinker"]["activations_bytes"] > 0
    # the talker's and code2wav's weights are theirs, not the whole checkpoint's
    weights = {name: out["stages"][name]["weights_bytes"] for name in out["stages"]}
    assert weights["talker"] < weights["thinker"] / 10 and weights["code2wav"] < weights["thinker"] / 10, weights
