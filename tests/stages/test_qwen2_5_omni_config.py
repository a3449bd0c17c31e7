"""The Qwen2.5-Omni stage configs: validation and a run through the Omni API (local backend)."""
from __future__ import annotations

import numpy as np
import pytest

from omni.config.loader import load_config
from tests.stages.omni_utils import image

TINY = "stage_configs/qwen2_5_omni_tiny.yaml"


def test_configs_validate(monkeypatch, tmp_path):
    cfg = load_config(TINY)
    assert [s.name for s in cfg.stages] == ["thinker", "talker", "token2wav"]
    with pytest.raises(ValueError, match="prefix caching does not apply"):
        load_config(TINY, stage_overrides={"token2wav": {"enable_prefix_caching": True}})
    monkeypatch.setenv("QWEN2_5_OMNI_PATH", str(tmp_path))
    big = load_config("stage_configs/qwen2_5_omni_7b.yaml")
    assert big.stage("thinker").model_path == str(tmp_path)


@pytest.mark.slow
def test_tiny_pipeline_through_the_omni_api(tiny_omni):
    from omni import Omni

    overrides = {"thinker": {"sampling": {"max_tokens": 4}}, "talker": {"sampling": {"max_tokens": 6}}}
    with Omni(TINY, stage_overrides=overrides, backend="local") as o:
        outs = o.generate([{"prompt": "What is this?", "multi_modal_data": {"image": image(0)}}], use_tqdm=False)
    out = outs[0]
    assert out.error is None
    assert len(out.outputs["thinker"].token_ids) == 4 and out.outputs["thinker"].text
    audio = out.outputs["token2wav"].audio
    assert audio.dtype == np.float32 and audio.ndim == 1 and audio.size > 0


@pytest.mark.slow
def test_tiny_pipeline_on_ray(tiny_omni, ray_cluster):
    """One actor per stage (on the session's shared cluster): images/audio in, numpy rows between actors,
    a waveform out."""
    from omni import Omni
    from tests.stages.omni_utils import audio

    overrides = {"thinker": {"sampling": {"max_tokens": 3}}, "talker": {"sampling": {"max_tokens": 4}}}
    with Omni(TINY, stage_overrides=overrides) as o:
        outs = o.generate([{"prompt": "Hi", "multi_modal_data": {"audio": audio(1)}},
                           {"prompt": "Look", "multi_modal_data": {"image": image(1)}}], use_tqdm=False)
    assert len(outs) == 2
    for out in outs:
        assert out.error is None
        assert len(out.outputs["thinker"].token_ids) == 3
        assert out.outputs["token2wav"].audio.size > 0
