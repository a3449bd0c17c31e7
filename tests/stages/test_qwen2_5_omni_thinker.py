"""Qwen2.5-Omni thinker stage vs transformers; multimodal prefix caching and the encoder cache."""
from __future__ import annotations

import numpy as np
import pytest

from omni.sampling_params import SamplingParams
from omni.messages import MultiModalInput, StageInput
from tests.engine_utils import assert_no_leak, make_engine, run_to_completion
from tests.stages.omni_utils import CASES, THINKER_MAX, hf_generate, hf_inputs, image, thinker_atol
from tests.tolerances import assert_rows_close

GREEDY = SamplingParams(temperature=0.0, max_tokens=THINKER_MAX)


def _run(engine, inputs: list[StageInput]):
    for inp in inputs:
        engine.add_request(inp)
    return run_to_completion(engine)


def _fresh(stage):
    stage.encoder_cache.clear()
    stage.encoder_cache.runs = stage.encoder_cache.hits = 0
    return stage


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [512, 16])
def test_thinker_matches_transformers(thinker_stage, hf_omni, chunk):
    """Text-only, image and audio prompts, batched together (and chunked so an image straddles steps)."""
    stage = _fresh(thinker_stage)
    engine = make_engine(None, model=stage, block_size=4, max_num_batched_tokens=chunk)
    inputs = [StageInput(name, prompt=p, mm_inputs=mm, sampling_params=GREEDY) for name, (p, mm) in CASES.items()]
    outs = _run(engine, inputs)
    for inp in inputs:
        ids, kw = hf_inputs(stage, inp)
        ref, _, _ = hf_generate(hf_omni, ids, kw, audio_out=False)
        out = outs[inp.request_id]
        assert out.prompt_token_ids == ids
        assert out.token_ids == ref, inp.request_id
        assert out.hidden_states.shape == (len(ids) + len(out.token_ids) - 1, stage.hidden_size)
        # The talker needs the prompt's 3-D rotary positions: handed downstream per token.
        pos, _ = stage.rope_index(ids, stage.preprocess(inp).extra["thinker"].items)
        np.testing.assert_array_equal(out.mm_outputs["mrope_positions"][: len(ids)], pos.t().numpy())
    assert len({tuple(o.token_ids) for o in outs.values()}) == 3
    assert stage.encoder_cache.runs == 2  # one image + one audio, each encoded once even when chunked
    assert_no_leak(engine)


def test_prompts_differing_only_in_image_share_no_image_block(thinker_stage):
    stage = _fresh(thinker_stage)
    engine = make_engine(None, model=stage, block_size=4)
    prompt = "Describe it."
    a = StageInput("a", prompt=prompt, mm_inputs=[MultiModalInput("image", image(1))], sampling_params=GREEDY)
    b = StageInput("b", prompt=prompt, mm_inputs=[MultiModalInput("image", image(2))], sampling_params=GREEDY)
    pa, pb = stage.preprocess(a), stage.preprocess(b)
    assert pa.token_ids == pb.token_ids  # identical placeholder tokens: only the image content differs
    out_a = _run(engine, [a])["a"]
    out_b = _run(engine, [b])["b"]
    offset = pa.mm_features[0].offset
    assert out_b.num_cached_tokens <= offset  # only the text blocks before the image are shared
    assert out_b.num_cached_tokens > 0
    ref_engine = make_engine(None, model=stage, block_size=4, caching=False)
    ref = _run(ref_engine, [StageInput("b", prompt=prompt, mm_inputs=b.mm_inputs, sampling_params=GREEDY)])["b"]
    assert out_b.token_ids == ref.token_ids
    atol = thinker_atol(ref.hidden_states)
    assert_rows_close(out_b.hidden_states, ref.hidden_states, atol)
    # ...and the other image's rows really differ: by more than rounding could, from the image on.
    n = min(len(out_a.hidden_states), len(out_b.hidden_states))
    assert np.abs(out_a.hidden_states[offset:n] - out_b.hidden_states[offset:n]).max() > atol
    assert_no_leak(engine)


def test_encoder_cache_hit_when_image_straddles_cached_and_fresh_block(thinker_stage):
    stage = _fresh(thinker_stage)
    img = [MultiModalInput("image", image(3))]
    first = StageInput("first", prompt="Tell me about it.", mm_inputs=img, sampling_params=GREEDY)
    second = StageInput("second", prompt="Is it red?", mm_inputs=img, sampling_params=GREEDY)
    p1, p2 = stage.preprocess(first), stage.preprocess(second)
    feat = p1.mm_features[0]
    end = feat.offset + feat.length
    diff = next(i for i, (x, y) in enumerate(zip(p1.token_ids, p2.token_ids)) if x != y)
    # A block size where the first differing token shares a block with the image's tail, while an
    # earlier block lies inside the image: that block hits, the image's tail is recomputed.
    bs = next(b for b in range(3, 16) if feat.offset < (diff // b) * b < end)
    engine = make_engine(None, model=stage, block_size=bs)
    _run(engine, [first])
    assert stage.encoder_cache.runs == 1
    hits_before = stage.encoder_cache.hits
    out = _run(engine, [second])["second"]
    assert feat.offset < out.num_cached_tokens < end  # the hit ends inside the image
    assert stage.encoder_cache.runs == 1  # the image tail came from the encoder cache
    assert stage.encoder_cache.hits > hits_before
    ref_engine = make_engine(None, model=_fresh(stage), block_size=bs, caching=False)
    ref = _run(ref_engine, [StageInput("second", prompt="Is it red?", mm_inputs=img, sampling_params=GREEDY)])
    assert out.token_ids == ref["second"].token_ids
    assert_rows_close(out.hidden_states, ref["second"].hidden_states, thinker_atol(ref["second"].hidden_states))
    assert_no_leak(engine)


def test_bad_multimodal_input_is_a_clear_error(thinker_stage):
    engine = make_engine(None, model=thinker_stage, block_size=4)
    with pytest.raises(ValueError, match="modality"):
        engine.add_request(StageInput("x", prompt="hi", mm_inputs=[MultiModalInput("voice", image(0))]))
    with pytest.raises(ValueError, match=r"video\[0\]: expected a video file's bytes .* shape \(56, 84, 3\)"):
        engine.add_request(StageInput("x", prompt="hi", mm_inputs=[MultiModalInput("video", image(0))]))
    with pytest.raises(ValueError, match="placeholder"):
        engine.add_request(StageInput("y", prompt="<|vision_bos|><|IMAGE|><|vision_eos|> hi"))
    assert not engine.has_unfinished()


def test_audio_and_image_in_one_prompt_match_transformers(thinker_stage, hf_omni):
    from tests.stages.omni_utils import audio

    stage = _fresh(thinker_stage)
    engine = make_engine(None, model=stage, block_size=4, max_num_batched_tokens=32)
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "and"}, {"type": "image"},
                                             {"type": "text", "text": "Which came first?"}]}]
    # mm_inputs are matched to placeholders per modality, in order (as transformers' processor does).
    inp = StageInput("mixed", prompt=messages, sampling_params=GREEDY,
                     mm_inputs=[MultiModalInput("image", image(5, 84, 56)), MultiModalInput("audio", audio(5, 1.5), 16000)])
    out = _run(engine, [inp])["mixed"]
    ids, kw = hf_inputs(stage, inp)
    ref, _, _ = hf_generate(hf_omni, ids, kw, audio_out=False)
    assert out.token_ids == ref
    feats = stage.preprocess(inp).mm_features
    assert [f.offset for f in feats] == sorted(f.offset for f in feats)  # audio first in the prompt
    assert_no_leak(engine)


@pytest.mark.slow
def test_preempted_multimodal_requests_still_match_transformers(thinker_stage, hf_omni):
    """Too few KV blocks for the batch: requests are preempted and recomputed, encoders come from cache."""
    stage = _fresh(thinker_stage)
    engine = make_engine(None, model=stage, block_size=4, num_blocks=30, max_num_batched_tokens=32)
    inputs = [StageInput(name, prompt=p, mm_inputs=mm, sampling_params=GREEDY) for name, (p, mm) in CASES.items()]
    outs = _run(engine, inputs)
    assert engine.stats().preemptions > 0
    for inp in inputs:
        ids, kw = hf_inputs(stage, inp)
        ref, _, _ = hf_generate(hf_omni, ids, kw, audio_out=False)
        assert outs[inp.request_id].token_ids == ref, inp.request_id
    assert stage.encoder_cache.runs == 2
    assert_no_leak(engine)


def test_the_first_delta_and_an_abort_report_the_prompts_split_as_its_final_output(thinker_stage):
    """What usage splits a prompt by (its prefix-cache hit, its placeholder tokens per modality and those of them
    cached) is known once the prompt is scheduled: the first delta of a streamed request carries it, and so does
    an aborted request's output, as the finished output reports it. A reply cancelled midway (reply_stream.Run)
    reads it there: it never sees the final output."""
    from tests.stages.omni_utils import audio

    stage = _fresh(thinker_stage)
    engine = make_engine(None, model=stage, block_size=4)
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is it?"}]}]

    def request(rid: str, **kw) -> StageInput:
        return StageInput(rid, prompt=messages, mm_inputs=[MultiModalInput("audio", audio(3, 1.0), 16000)],
                          sampling_params=GREEDY, **kw)

    _run(engine, [request("warm")])  # the caches hold the prompt from here on: every run below hits alike
    engine.add_request(request("cut", stream=True))
    first = engine.step().deltas[0]
    engine.abort("cut")
    (aborted,) = engine.step().aborted
    done = _run(engine, [request("done")])["done"]
    assert done.prompt_mm_tokens == {"audio": 25} and done.cached_mm_tokens["audio"] > 0  # 1 s: 25 audio tokens
    want = (done.num_cached_tokens, done.prompt_mm_tokens, done.cached_mm_tokens)
    assert (first.num_cached_tokens, first.prompt_mm_tokens, first.cached_mm_tokens) == want
    assert (aborted.num_cached_tokens, aborted.prompt_mm_tokens, aborted.cached_mm_tokens) == want
    assert_no_leak(engine)
