"""The Qwen2.5-Omni stages read their cache geometry from the checkpoint's config without loading it."""
from __future__ import annotations

from omni.engine.memory import StageGeometry


def loaded_geometry(stage) -> StageGeometry:
    spec = stage.kv_spec()
    return StageGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, stage.hidden_size)


def test_thinker_and_talker_geometry_match_the_loaded_models(tiny_omni, thinker_stage, talker_stage):
    from stages.qwen2_5_omni.edges import Qwen2_5OmniTalkerStage, Qwen2_5OmniThinkerStage

    assert Qwen2_5OmniThinkerStage.checkpoint_geometry(tiny_omni) == loaded_geometry(thinker_stage)
    assert Qwen2_5OmniTalkerStage.checkpoint_geometry(tiny_omni) == loaded_geometry(talker_stage)
    # the talker's own hidden states are narrower than the thinker's rows it is fed
    assert loaded_geometry(talker_stage).hidden_size != loaded_geometry(thinker_stage).hidden_size
