"""Higgs Audio v2's prompt equals `HiggsAudioV2Processor.apply_chat_template`'s: token ids and the audio frames of
the audio positions, for a voice's reference turn, a scene and chat messages (the processor is given an audio
tokenizer that returns the same codes ours encodes: transformers' own cannot load beside this torch)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni.errors import RequestError
from omni.messages import MultiModalInput, StageInput
from stages.checkpoints.builtin import builtin_path
from stages.higgs_audio_v2.checkpoint import CHAT_TEMPLATE
from tests.stages.higgs_audio_v2.higgs_utils import VOICE_TEXT, load_stage, voice_codes


def _processor(tokenizer, config, codes: np.ndarray):
    from transformers import DacConfig, DacFeatureExtractor, DacModel, HiggsAudioV2Processor

    codec = DacModel(DacConfig(encoder_hidden_size=4, downsampling_ratios=[2], decoder_hidden_size=4,
                               upsampling_ratios=[2], hidden_size=4, n_codebooks=2, codebook_size=4, codebook_dim=2))
    codec.config.num_quantizers = codes.shape[0]
    codec.encode = lambda input_values, **kw: SimpleNamespace(audio_codes=torch.tensor(codes)[None])
    return HiggsAudioV2Processor(DacFeatureExtractor(sampling_rate=24000), tokenizer, codec,
                                 chat_template=CHAT_TEMPLATE,
                                 audio_stream_bos_id=config.audio_stream_bos_id,
                                 audio_stream_eos_id=config.audio_stream_eos_id)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import HiggsAudioV2Config

    path = builtin_path("tiny-higgs-audio-v2")
    config = HiggsAudioV2Config.from_pretrained(str(path))
    codes = voice_codes(config.num_codebooks, config.audio_stream_bos_id, 37)
    stage = load_stage(path, {"alice": codes}, tmp_path_factory.mktemp("voices"))
    return stage, config, codes, _processor(stage.tokenizer, config, codes)


def _frames(prompt) -> np.ndarray:
    at = prompt.extra["frames_at"]
    return np.stack([at[p] for p in sorted(at)])


def _text(t: str) -> list[dict]:
    return [{"type": "text", "text": t}]


@pytest.mark.parametrize("scene", [None, "Audio is recorded from a quiet room."])
def test_voice_prompt_equals_the_processor(setup, scene):
    stage, config, codes, proc = setup
    conv = [{"role": "system", "content": _text("Generate audio following instruction.")}]
    if scene:
        conv.append({"role": "scene", "content": _text(scene)})
    conv += [{"role": "user", "content": _text(VOICE_TEXT)},
             {"role": "assistant", "content": [{"type": "audio", "audio": np.zeros(2400, np.float32)}]},
             {"role": "user", "content": _text("The sun rises in the east.")}]
    want = proc.apply_chat_template(conv, tokenize=True, return_dict=True, return_tensors="pt",
                                    sampling_rate=24000, add_generation_prompt=True)
    ours = stage.prompter.prepare(StageInput("a", prompt="The sun rises in the east.",
                                             extra={"speaker": "alice", "instructions": scene}))
    assert ours.token_ids == want["input_ids"][0].tolist()
    np.testing.assert_array_equal(_frames(ours), want["audio_input_ids"][0].numpy())
    (feature,) = ours.mm_features
    ids = np.array(ours.token_ids)
    assert feature.length == len(_frames(ours)) and set(ids[feature.offset:feature.offset + feature.length]) == {
        config.audio_token_id, config.audio_delay_token_id}


def test_chat_messages_with_a_clip_and_a_per_request_voice_render_alike(setup, monkeypatch):
    stage, config, codes, proc = setup
    monkeypatch.setattr(stage.prompter.voices, "encode", lambda item, where: codes)  # the codec's encoder
    clip = MultiModalInput("audio", np.zeros(4800, np.float32), 24000)
    messages = [{"role": "user", "content": VOICE_TEXT},
                {"role": "assistant", "content": [{"type": "audio"}]},
                {"role": "user", "content": "Speak this now."}]
    a = stage.prompter.prepare(StageInput("a", prompt=messages, mm_inputs=[clip]))
    b = stage.prompter.prepare(StageInput("b", prompt="Speak this now.", mm_inputs=[clip],
                                          extra={"reference_text": VOICE_TEXT}))
    c = stage.prompter.prepare(StageInput("c", prompt="Speak this now.", extra={"speaker": "alice"}))
    assert a.token_ids == b.token_ids == c.token_ids
    np.testing.assert_array_equal(_frames(a), _frames(c))


@pytest.mark.parametrize("prompt,media,field", [
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}], 0, "prompt[0].content"),
    ([{"role": "user", "content": [{"type": "audio"}]}], 1, "prompt[0].content[0]"),
    ([{"role": "robot", "content": "hi"}, {"role": "user", "content": "x"}], 0, "prompt[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "audio"}]}], 1, "prompt"),
    ("Say it.", 1, "multi_modal_data"),
])
def test_bad_conversations_are_refused_by_field(setup, prompt, media, field):
    stage, *_ = setup
    clips = [MultiModalInput("audio", np.zeros(2400, np.float32), 24000)] * media
    with pytest.raises(RequestError) as e:
        stage.prompter.prepare(StageInput("x", prompt=prompt, mm_inputs=clips))
    assert e.value.field == field
