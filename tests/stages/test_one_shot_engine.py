"""OneShotStageEngine with the Qwen2.5-Omni token2wav stage (no KV cache)."""
from __future__ import annotations

import numpy as np
import pytest

from omni.engine.one_shot_engine import OneShotEngineConfig, OneShotStageEngine
from omni.outputs import StageInput


def _config(model, name="token2wav", **kw):
    return OneShotEngineConfig(name, type(model), None, **kw)


def _drain(engine):
    outs = {}
    while engine.has_unfinished():
        step = engine.step()
        for o in step.aborted + step.finished:
            outs[o.request_id] = o
    return outs


@pytest.mark.slow
def test_token2wav_engine_deterministic_and_isolated(token2wav_stage):
    engine = OneShotStageEngine(_config(token2wav_stage, max_num_seqs=2), model=token2wav_stage)
    codes = [11, 500, 2048, 7, 7, 900]
    engine.add_request(StageInput("a", prompt_token_ids=codes))
    engine.add_request(StageInput("b", prompt_token_ids=codes, sampling_params={"seed": 3}))
    engine.add_request(StageInput("c", prompt_token_ids=codes, extra={"speaker": "Ethan"}))
    engine.add_request(StageInput("d", prompt_token_ids=codes))
    engine.abort("d")
    outs = _drain(engine)
    assert outs["d"].finish_reason == "abort" and outs["d"].audio is None
    a, b, c = outs["a"].audio, outs["b"].audio, outs["c"].audio
    assert a.dtype == np.float32 and a.ndim == 1 and a.size > 0 and np.isfinite(a).all()
    assert not np.array_equal(a, b)  # another noise seed
    assert not np.array_equal(a, c)  # another speaker
    engine.add_request(StageInput("a2", prompt_token_ids=codes))
    np.testing.assert_array_equal(_drain(engine)["a2"].audio, a)  # same codes + seed: same waveform
    st = engine.stats().as_dict()
    assert st["finished"] == 4 and st["prefix_caching"] is False and st["waiting"] == 0


def test_token2wav_bad_requests_are_clear_errors(token2wav_stage):
    engine = OneShotStageEngine(_config(token2wav_stage), model=token2wav_stage)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request(StageInput("x", prompt_token_ids=[10**6]))
    with pytest.raises(ValueError, match="at least one"):
        engine.add_request(StageInput("y", prompt_token_ids=[]))
    with pytest.raises(ValueError, match="speaker"):
        engine.add_request(StageInput("z", prompt_token_ids=[1, 2], extra={"speaker": "Nobody"}))
    assert not engine.has_unfinished()


def test_autoregressive_model_is_rejected(thinker_stage):
    with pytest.raises(ValueError, match="autoregressive"):
        OneShotStageEngine(_config(thinker_stage, name="x"), model=thinker_stage)
