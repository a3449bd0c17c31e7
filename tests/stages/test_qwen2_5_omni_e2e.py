"""thinker -> talker -> token2wav vs transformers' Qwen2_5OmniForConditionalGeneration.generate."""
from __future__ import annotations

import numpy as np
import pytest

from omni.outputs import StageInput
from stages.qwen2_5_omni import talker2wav, thinker2talker
from tests.stages.omni_utils import CASES, hf_generate, hf_inputs, make_chain, run_chain

# The same codes and noise seed give the same waveform; the tolerance covers float reassociation
# only (we measured a maximum difference of 0 on CPU, fp32).
WAVE_ATOL = 1e-5


@pytest.mark.slow
def test_pipeline_matches_transformers_generate(thinker_stage, talker_stage, token2wav_stage, hf_omni):
    chain = make_chain(thinker_stage, talker_stage, token2wav_stage)
    inputs = [StageInput(name, prompt=p, mm_inputs=mm) for name, (p, mm) in CASES.items()]
    results = run_chain(chain, inputs)
    for inp in inputs:
        thinker_out, talker_out, wav_out = results[inp.request_id]
        ids, kw = hf_inputs(thinker_stage, inp)
        ref_tokens, ref_codes, ref_wav = hf_generate(hf_omni, ids, kw, audio_out=True)
        assert thinker_out.token_ids == ref_tokens, inp.request_id
        assert talker2wav({"talker": talker_out}, inp).prompt_token_ids == ref_codes, inp.request_id
        assert wav_out.audio.dtype == np.float32 and wav_out.audio.shape == ref_wav.shape
        np.testing.assert_allclose(wav_out.audio, ref_wav, atol=WAVE_ATOL, rtol=0)
    assert len({tuple(r[1].token_ids) for r in results.values()}) == 3


def test_thinker2talker_and_talker2wav_contracts(thinker_stage, talker_stage):
    from omni.outputs import StageOutput

    with pytest.raises(ValueError, match="hidden states"):
        thinker2talker({"thinker": StageOutput("r", "thinker", prompt_token_ids=[1, 2], token_ids=[3, 4])},
                       StageInput("r"))
    with pytest.raises(ValueError, match="failed"):
        thinker2talker({"thinker": StageOutput("r", "thinker", error="boom")}, StageInput("r"))
    inp = talker2wav({"talker": StageOutput("r", "talker", token_ids=[5, 6, 8294, 7])},
                     StageInput("r", extra={"speaker": "Ethan"}))
    assert inp.prompt_token_ids == [5, 6] and inp.extra["speaker"] == "Ethan"
    with pytest.raises(ValueError, match="no codec tokens"):
        talker2wav({"talker": StageOutput("r", "talker", token_ids=[8292])}, StageInput("r"))
    with pytest.raises(ValueError, match="thinker"):
        talker_stage.preprocess(StageInput("r"))
