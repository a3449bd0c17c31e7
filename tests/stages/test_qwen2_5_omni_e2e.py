"""thinker -> talker -> token2wav vs transformers' Qwen2_5OmniForConditionalGeneration.generate."""
from __future__ import annotations

import numpy as np
import pytest

from omni.messages import StageInput
from stages.qwen2_5_omni.edges import talker2wav, thinker2talker
from tests.stages.omni_utils import CASES, TALKER_LAYERS, hf_generate, hf_inputs, make_chain, run_chain
from tests.tolerances import decoder_atol, reorder_atol



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
        # The same codes and noise seed through exactly transformers' tensor ops in the same order and
        # shapes (stages/qwen2_5_omni/dit.py): the waveform is bitwise transformers'.
        np.testing.assert_array_equal(wav_out.audio, ref_wav)
    assert len({tuple(r[1].token_ids) for r in results.values()}) == 3


def test_thinker2talker_and_talker2wav_contracts(thinker_stage, talker_stage):
    from omni.messages import StageOutput

    with pytest.raises(ValueError, match="hidden states"):
        thinker2talker({"thinker": StageOutput("r", "thinker", prompt_token_ids=[1, 2], token_ids=[3, 4])},
                       StageInput("r"))
    with pytest.raises(ValueError, match="failed"):
        thinker2talker({"thinker": StageOutput("r", "thinker", error="boom")}, StageInput("r"))
    inp = talker2wav({"talker": StageOutput("r", "talker", token_ids=[5, 6, 8294, 7])},
                     StageInput("r", extra={"speaker": "Ethan"}))
    assert inp.prompt_token_ids == [5, 6] and inp.payload.speaker == "Ethan"
    # a talker whose eos came first said nothing: token2wav gets no codes (and makes no audio)
    assert talker2wav({"talker": StageOutput("r", "talker", token_ids=[8292])}, StageInput("r")).prompt_token_ids == []
    with pytest.raises(ValueError, match="thinker"):
        talker_stage.preprocess(StageInput("r"))


def test_mrope_talker_prefill_matches_transformers_forward(thinker_stage, talker_stage, hf_omni):
    """transformers_compat=False: the talker prefill equals transformers' talker forward *with* its
    attention mask (codec bos/pad embeddings added, 3-D positions from input_text_ids + image grid)."""
    import torch

    from omni.sampling_params import SamplingParams
    from tests.engine_utils import make_engine, run_to_completion

    inp = StageInput("image", prompt=CASES["image"][0], mm_inputs=CASES["image"][1])
    engine = make_engine(None, model=thinker_stage, default_sampling=SamplingParams(temperature=0, max_tokens=4))
    engine.add_request(inp)
    thinker_out = run_to_completion(engine)["image"]
    talker_inp = thinker2talker({"thinker": thinker_out}, inp)
    ids, kw = hf_inputs(thinker_stage, inp)
    L = len(ids)
    talker_stage.transformers_compat = False
    try:
        rows = talker_stage.preprocess(talker_inp).prompt_embeds.copy()
        k_engine = make_engine(None, model=talker_stage, default_sampling=SamplingParams(temperature=0, max_tokens=1))
        k_engine.add_request(talker_inp)
        ours = run_to_completion(k_engine)["image"]
    finally:
        talker_stage.transformers_compat = True
    talker = hf_omni.talker
    with torch.inference_mode():
        codec = talker_stage.codec_embed(torch.tensor([talker.codec_pad_token, talker.codec_bos_token])).numpy()
        rows[-2] -= codec[0]  # transformers' forward adds these two itself
        rows[-1] -= codec[1]
        bos = talker_stage.speakers["Chelsie"]["bos_token"]
        talker.rope_deltas = None
        ref = talker(inputs_embeds=torch.from_numpy(rows)[None], attention_mask=torch.ones(1, L + 2, dtype=torch.long),
                     input_text_ids=torch.tensor([ids + [bos, thinker_out.token_ids[0]]]),
                     image_grid_thw=kw["image_grid_thw"], use_cache=False).logits[0, -1]
        hidden = ours.hidden_states[L + 1 : L + 2]
        got = talker_stage.compute_logits(torch.from_numpy(hidden))[0]
        ref[talker.codec_bos_token] = float("-inf")
        head = talker_stage.talker.codec_head.weight.detach().abs().double()  # [vocab, hidden]
    # Our paged talker prefill vs transformers' dense forward: the hidden row is within the decoder
    # bound (thinker rows fed in are the same numbers both ways; the talker's 2 layers, longest sum
    # 64 terms or the L + 2 rows); the codec head's sum grows that error by at most the row's sum of
    # |weights| and adds its own reordering at the scale sum|h_i w_i|.
    atol_h = decoder_atol(hidden, layers=TALKER_LAYERS, widest_sum=max(64, L + 2))
    h = torch.from_numpy(np.abs(hidden[0])).double()
    atol = atol_h * float(head.sum(1).max()) + reorder_atol(head.shape[1], float((head @ h).max()))
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)
