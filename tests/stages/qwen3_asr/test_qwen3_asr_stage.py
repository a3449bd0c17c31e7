"""Qwen3-ASR stage vs transformers' `Qwen3ASRForConditionalGeneration.generate` on the tiny checkpoint, with real
recorded speech: greedy tokens with prefix caching on and off, clips of different lengths batched in one engine
(and chunked so a clip straddles steps), the text as the processor decodes it, and a repeated clip served from the
encoder cache and the prefix cache."""
from __future__ import annotations

import pytest

from omni.messages import MultiModalInput, StageInput
from omni.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leak, make_engine, run_to_completion
from tests.tolerances import assert_rows_close, decoder_atol
from tests.stages.qwen3_asr.asr_utils import EOS_TEXT, MAX_TOKENS, clips, hf_generate, shown_text

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[EOS_TEXT])
# (clip, language, context): the processor's options, each clip with a different one
CASES = {"short": ("short", None, None), "a": ("a", "en", None), "b": ("b", None, "Beckett, Godot"),
         "whole": ("whole", "English", "a reading")}


def _fresh(stage):
    stage.encoder_cache.clear()
    stage.encoder_cache.runs = stage.encoder_cache.hits = 0
    return stage


def _request(rid: str, clip, language: str | None = None, context: str | None = None) -> StageInput:
    return StageInput(rid, prompt=context, mm_inputs=[MultiModalInput("audio", clip, 16000)], sampling_params=GREEDY,
                      mm_processor_kwargs={"language": language} if language else None)


@pytest.fixture(scope="module")
def reference(hf_asr, asr_processor):
    """transformers' (prompt ids, reply ids) per case, each clip alone (as the processor prepares one clip)."""
    audio = clips()
    return {k: hf_generate(hf_asr, asr_processor, audio[c], lang, ctx) for k, (c, lang, ctx) in CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("caching,chunk", [(True, 512), (False, 512), (True, 16)])
def test_batched_clips_match_transformers(asr_stage, asr_processor, reference, caching, chunk):
    stage = _fresh(asr_stage)
    engine = make_engine(None, model=stage, caching=caching, block_size=4, max_num_batched_tokens=chunk)
    audio = clips()
    for k, (c, lang, ctx) in CASES.items():
        engine.add_request(_request(k, audio[c], lang, ctx))
    outs = run_to_completion(engine)
    for k, (ids, ref) in reference.items():
        out = outs[k]
        assert out.error is None, out.error
        assert out.prompt_token_ids == ids, k  # the processor's prompt, placeholders expanded
        assert out.token_ids == ref, k
        assert out.text == shown_text(asr_processor, ref), k
    assert len({tuple(o.token_ids) for o in outs.values()}) == len(CASES)  # the audio decides the reply
    assert stage.encoder_cache.runs == len(CASES)  # each clip encoded once, even when its run spans steps
    assert_no_leak(engine)


def test_a_repeated_clip_hits_the_encoder_cache_and_the_prefix_cache(asr_stage, reference):
    stage = _fresh(asr_stage)
    engine = make_engine(None, model=stage, block_size=4)
    clip = clips()["a"]
    engine.add_request(_request("first", clip, "en"))
    first = run_to_completion(engine)["first"]
    assert (stage.encoder_cache.runs, stage.encoder_cache.hits) == (1, 0)
    assert first.num_cached_tokens == 0
    # Another context: the system turn differs, so the clip's rows are recomputed from the encoder cache.
    engine.add_request(_request("context", clip, "en", "Beckett"))
    other = run_to_completion(engine)["context"]
    assert (stage.encoder_cache.runs, stage.encoder_cache.hits) == (1, 1)
    assert other.num_cached_tokens < 8
    # The same request again: its whole prompt but the last block comes from the prefix cache.
    engine.add_request(_request("again", clip, "en"))
    again = run_to_completion(engine)["again"]
    n = len(again.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // 4 * 4 and again.cached_mm_tokens["audio"] > 0
    assert again.token_ids == first.token_ids == reference["a"][1]
    # ...and hands on the whole sequence's hidden states: cached rows + fresh ones, as computed the first time
    ref = first.hidden_states
    assert again.hidden_states.shape == ref.shape == (n + len(first.token_ids) - 1, stage.hidden_size)
    assert_rows_close(again.hidden_states, ref, decoder_atol(ref, layers=3, widest_sum=max(128, len(ref))))
    stats = engine.stats()  # what a caller sees: the model's encoder counters and the KV cache's hits
    assert (stats.extra["encoder_runs"], stats.extra["encoder_cache_hits"]) == (1, 1)
    assert stats.prefix_cache_hits >= again.num_cached_tokens // 4
    assert_no_leak(engine)


def test_prompts_differing_only_in_their_clip_share_no_block_past_the_audio(asr_stage):
    stage = _fresh(asr_stage)
    engine = make_engine(None, model=stage, block_size=4)
    audio = clips()
    a, b = _request("x", audio["a"]), _request("y", audio["a"][::-1].copy())
    pa, pb = stage.preprocess(a), stage.preprocess(b)
    assert pa.token_ids == pb.token_ids  # identical placeholders: only the audio differs
    engine.add_request(a)
    run_to_completion(engine)
    engine.add_request(b)
    out = run_to_completion(engine)["y"]
    assert 0 < out.num_cached_tokens <= pa.mm_features[0].offset
    assert_no_leak(engine)
