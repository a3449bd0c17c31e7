"""Higgs Audio v2's LLM stage equals transformers' `HiggsAudioV2ForConditionalGeneration.generate`: greedy frames
(every codebook, under the delay pattern) with prefix caching on and off, with and without a reference voice,
batched with requests of other lengths, and for a second request in the same voice that hits the cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.errors import RequestError
from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from stages.checkpoints.builtin import builtin_path
from stages.higgs_audio_v2.model import HiggsAudioV2Stage
from tests.engine_utils import assert_no_leak, run_to_completion
from tests.stages.higgs_audio_v2.higgs_utils import engine_for, hf_frames, load_stage, run, voice_codes

TEXTS = ["The sun rises in the east.", "A second, rather longer sentence to speak now, slowly.", "Yes."]


@pytest.fixture(scope="module", params=["tiny", "k8"])
def setup(request, tmp_path_factory):
    from transformers import HiggsAudioV2ForConditionalGeneration

    path = builtin_path(f"tiny-higgs-audio-v2{'' if request.param == 'tiny' else '-k8'}")
    hf = HiggsAudioV2ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    k, c = hf.config.num_codebooks, hf.config.audio_stream_bos_id
    voices = {"alice": voice_codes(k, c, 40, 0), "bob": voice_codes(k, c, 33, 1)}
    stage = load_stage(path, voices, tmp_path_factory.mktemp("voices"))
    return path, hf, stage, voices


@pytest.mark.parametrize("caching", [True, False])
def test_batched_frames_equal_transformers_generate(setup, caching):
    path, hf, stage, voices = setup
    engine = engine_for(stage, path, caching=caching)
    reqs = [(TEXTS[0], "alice"), (TEXTS[1], None), (TEXTS[2], "bob"), (TEXTS[1], "alice")]
    got = run(engine, reqs)
    for (text, voice), (frames, _) in zip(reqs, got):
        want = hf_frames(hf, stage, text, voices.get(voice), voice_name=voice)
        np.testing.assert_array_equal(frames, want)
        assert (frames[0] == hf.config.audio_stream_bos_id).all()  # the generation starts all stream-bos
    assert_no_leak(engine)


def test_second_request_in_a_voice_hits_the_cache_and_equals_transformers(setup):
    path, hf, stage, voices = setup
    engine = engine_for(stage, path)
    (first, o1), = run(engine, [(TEXTS[0], "alice")], prefix="a")
    (second, o2), = run(engine, [(TEXTS[1], "alice")], prefix="b")
    # the voice reference (system turn, transcript, every frame of the clip) is a cached prefix of the second
    assert o2.num_cached_tokens >= 16 * ((len(voices["alice"][0]) + 4 + 20) // 16)
    np.testing.assert_array_equal(second, hf_frames(hf, stage, TEXTS[1], voices["alice"], voice_name="alice"))
    (again, o3), = run(engine, [(TEXTS[1], "bob")], prefix="c")
    np.testing.assert_array_equal(again, hf_frames(hf, stage, TEXTS[1], voices["bob"], voice_name="bob"))
    assert_no_leak(engine)


def test_one_residual_code_changes_the_voice_blocks(setup, tmp_path):
    path, hf, stage, voices = setup
    other = voices["alice"].copy()
    other[-1, 3] = (other[-1, 3] + 1) % hf.config.audio_stream_bos_id  # one code of the last codebook
    twin = load_stage(path, {"alice": voices["alice"], "twin": other}, tmp_path)
    a = twin.prompter.prepare(StageInput("a", prompt=TEXTS[0], extra={"speaker": "alice"}))
    b = twin.prompter.prepare(StageInput("b", prompt=TEXTS[0], extra={"speaker": "twin"}))
    assert a.token_ids == b.token_ids  # the same placeholders...
    assert a.mm_features[0].mm_hash != b.mm_features[0].mm_hash  # ...never the same blocks


def test_seeded_sampling_is_reproducible(setup):
    path, hf, stage, voices = setup
    params = dict(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    (a, _), = run(engine_for(stage, path), [(TEXTS[0], "alice")], prefix="s", **params)
    (b, _), (c, _) = run(engine_for(stage, path), [(TEXTS[0], "alice"), (TEXTS[1], None)], prefix="t", **params)
    np.testing.assert_array_equal(a, b)  # the same draws whatever shares the batch


def test_min_tokens_keeps_every_codebook_going_as_a_masked_stream_eos_in_generate_does(setup):
    """min_tokens: no codebook may end before that many frames (stream-eos masked); the frames equal
    transformers' generate with the same mask (the bench's min_frames_processor), batched with a request without one."""
    path, hf, stage, voices = setup
    eos = hf.config.audio_stream_eos_id
    (free, _), = run(engine_for(stage, path), [(TEXTS[2], "alice")], max_tokens=40, prefix="f")
    assert len(free) < 30  # left alone, this reply ends early (both tiny configurations)
    engine = engine_for(stage, path)
    engine.add_request(StageInput("m0", prompt=TEXTS[2], extra={"speaker": "alice"},
                                  sampling_params=SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30)))
    engine.add_request(StageInput("m1", prompt=TEXTS[1], sampling_params=SamplingParams(temperature=0.0, max_tokens=40)))
    outs = run_to_completion(engine)
    rows = {r: np.asarray(outs[r].mm_outputs["audio_codes"]).astype(np.int64) for r in ("m0", "m1")}
    held, other = (x[x[:, 0] >= 0] for x in rows.values())
    assert len(held) >= 30 and not (held[:30] == eos).any()
    np.testing.assert_array_equal(held, hf_frames(hf, stage, TEXTS[2], voices["alice"], 40, voice_name="alice",
                                                  min_frames=30))
    np.testing.assert_array_equal(other, hf_frames(hf, stage, TEXTS[1], None, 40))
    assert_no_leak(engine)


@pytest.mark.parametrize("field,value", [("logprobs", 2), ("ignore_eos", True)])
def test_text_token_options_are_refused_by_name(setup, field, value):
    path, hf, stage, voices = setup
    engine = engine_for(stage, path)
    with pytest.raises(RequestError, match="samples audio frames") as e:
        engine.add_request(StageInput("x", prompt="Hi.", sampling_params=SamplingParams(**{field: value})))
    assert e.value.field == field
    assert_no_leak(engine)


def test_unknown_voice_names_the_known_ones(setup):
    path, hf, stage, voices = setup
    with pytest.raises(RequestError, match="known: alice, bob") as e:
        stage.prompter.prepare(StageInput("x", prompt="Hi.", extra={"speaker": "carol"}))
    assert e.value.field == "voice"


@pytest.mark.slow
def test_a_directory_as_transformers_saves_the_model_and_processor_loads(setup, tmp_path):
    """The model as HiggsAudioV2ForConditionalGeneration.save_pretrained writes it, the tokenizer and chat template as
    the processor saves them, and the audio tokenizer wherever processor_config.json names it (no other file)."""
    import json
    import shutil

    from stages.higgs_audio_v2.checkpoint import CHAT_TEMPLATE
    from stages.higgs_audio_v2.codec import HiggsAudioV2CodecStage

    path, hf, stage, voices = setup
    model_dir, codec_dir = tmp_path / "model", tmp_path / "elsewhere" / "tokenizer"
    hf.save_pretrained(model_dir)
    stage.tokenizer.save_pretrained(model_dir)
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    shutil.copytree(path / "audio_tokenizer", codec_dir)
    (model_dir / "processor_config.json").write_text(json.dumps({
        "processor_class": "HiggsAudioV2Processor", "audio_tokenizer": {
            "audio_tokenizer_class": "HiggsAudioV2TokenizerModel", "audio_tokenizer_name_or_path": str(codec_dir)}}))
    loaded = HiggsAudioV2Stage.load(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    assert loaded.prompter.voices.codec_path == codec_dir
    a = loaded.prompter.prepare(StageInput("a", prompt=TEXTS[0]))
    assert a.token_ids == stage.prompter.prepare(StageInput("b", prompt=TEXTS[0])).token_ids
    codec = HiggsAudioV2CodecStage.load(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    assert codec.num_codebooks == hf.config.num_codebooks
    with pytest.raises(FileNotFoundError, match="no Higgs Audio v2 codec"):
        HiggsAudioV2CodecStage.load(tmp_path, dtype=torch.float32, device=torch.device("cpu"))
