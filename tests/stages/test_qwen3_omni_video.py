"""Qwen3-Omni's thinker with videos vs transformers' generate fed the same tensors (with and without the audio track
merged by time, prefix caching on and off, a video next to an image), and a video hashed into the blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.messages import MultiModalInput, StageInput
from omni.sampling_params import SamplingParams
from tests.engine_utils import assert_no_leak, make_engine, run_to_completion
from tests.stages.qwen3_omni_utils import THINKER_MAX, hf_model, hf_thinker_tokens, image, stages
from tests.stages.video_utils import clip_bytes, video_request

GREEDY = SamplingParams(temperature=0.0, max_tokens=THINKER_MAX)


def _fresh(stage):
    stage.encoder_cache.clear()
    stage.encoder_cache.runs = stage.encoder_cache.hits = 0
    return stage


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("name,with_audio", [("plain", False), ("talk", True), ("long", True)])
def test_thinker_with_a_video_matches_transformers_generate(name, with_audio, caching):
    """Chunked (48 tokens a step): the video's rows, and their deepstack rows (the video rows only, with the track
    merged in), straddle steps."""
    stage = _fresh(stages("tiny")[0])
    engine = make_engine(None, model=stage, block_size=4, max_num_batched_tokens=48, caching=caching)
    inp = video_request(name, name, with_audio, sampling_params=GREEDY)
    out = run_to_completion(_add(engine, inp))[name]
    assert out.token_ids == hf_thinker_tokens(inp)
    assert stage.encoder_cache.runs == 1
    assert_no_leak(engine)


def _add(engine, *inputs):
    for inp in inputs:
        engine.add_request(inp)
    return engine


def test_a_video_with_its_track_next_to_an_image_matches_transformers_generate():
    """Image and video deepstack rows in one prompt (transformers joins them by position), the track's rows between
    the video's; batched with the same video alone, which must hit the same blocks only up to the video."""
    stage = _fresh(stages("tiny")[0])
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"},
                                         {"type": "text", "text": "Same place?"}]}]
    mixed = StageInput("mixed", prompt=chat, sampling_params=GREEDY, mm_processor_kwargs={"use_audio_in_video": True},
                       mm_inputs=[MultiModalInput("video", clip_bytes("talk")), MultiModalInput("image", image(4))])
    engine = make_engine(None, model=stage, block_size=4, max_num_batched_tokens=64)
    outs = run_to_completion(_add(engine, mixed, video_request("alone", "talk", True, sampling_params=GREEDY)))
    assert outs["mixed"].token_ids == hf_thinker_tokens(mixed)
    meta = outs["mixed"].mm_outputs["mm_meta"]
    item = next(i for i in stage.preprocess(mixed).extra["thinker"].items if i.modality == "video")
    np.testing.assert_array_equal(meta[item.offset], item.grid_thw.tolist() + [item.second_per_grid])
    assert_no_leak(engine)


def test_pipeline_with_a_video_matches_transformers_generate_with_audio():
    """thinker -> talker -> code2wav with a video (the talker's 3-D positions from the video's grid and seconds per
    temporal patch in the thinker's mm_meta rows) against transformers' generate(return_audio=True): the same text,
    codec frames and waveform, bit for bit."""
    from tests.stages.qwen3_omni_utils import TALKER_MAX, frames_of, make_chain, run_chain

    inp = video_request("v", "plain", False)
    thinker_out, talker_out, wave_out = run_chain(make_chain("tiny"), [inp])["v"]
    prepared = stages("tiny")[0].preprocess(inp)
    (item,) = prepared.extra["thinker"].items
    model, frames = hf_model("tiny"), []
    decode = model.code2wav.chunked_decode

    def spy(codes, *a, **k):  # the frames transformers hands to code2wav
        frames.append(codes[0].T.numpy().copy())
        return decode(codes, *a, **k)

    model.code2wav.chunked_decode = spy
    x = torch.tensor([prepared.token_ids])
    try:
        with torch.inference_mode():
            seq, wav = model.generate(input_ids=x, pixel_values_videos=item.data, video_grid_thw=item.grid_thw[None],
                                      video_second_per_grid=torch.tensor([item.second_per_grid]),
                                      thinker_max_new_tokens=THINKER_MAX, thinker_do_sample=False,
                                      talker_max_new_tokens=TALKER_MAX, talker_do_sample=False,
                                      talker_repetition_penalty=1.05, return_audio=True, speaker="Ethan")
    finally:
        model.code2wav.chunked_decode = decode
    assert thinker_out.token_ids == seq[0, x.shape[1]:].tolist()
    np.testing.assert_array_equal(frames_of(talker_out, inp), frames[0])
    np.testing.assert_array_equal(wave_out.audio, wav.reshape(-1).float().numpy())


def test_the_talker_refuses_a_video_with_its_track_naming_the_setting():
    """transformers' talker cannot place a video's track (it is not told use_audio_in_video): refused, named."""
    from omni.errors import RequestError
    from stages.qwen3_omni.edges import thinker2talker

    thinker, talker, _ = stages("tiny")
    inp = video_request("av", "talk", True, sampling_params=SamplingParams(temperature=0.0, max_tokens=2))
    out = run_to_completion(_add(make_engine(None, model=thinker, block_size=4), inp))["av"]
    with pytest.raises(RequestError, match="talker cannot place a video's audio track") as e:
        talker.preprocess(thinker2talker({"thinker": out}, inp))
    assert e.value.field == "mm_processor_kwargs.use_audio_in_video"
    # ...where transformers' own generate fails (there is no reference to equal)
    prepared = thinker.preprocess(inp)
    (item,) = prepared.extra["thinker"].items
    x = torch.tensor([prepared.token_ids])
    with pytest.raises(AttributeError, match="audio_config"), torch.inference_mode():
        hf_model("tiny").generate(input_ids=x, pixel_values_videos=item.data, video_grid_thw=item.grid_thw[None],
                                  video_second_per_grid=torch.tensor([item.second_per_grid]), use_audio_in_video=True,
                                  input_features=item.audio.data[None],
                                  feature_attention_mask=torch.ones(1, item.audio.frames, dtype=torch.long),
                                  thinker_max_new_tokens=2, thinker_do_sample=False, talker_max_new_tokens=2,
                                  talker_do_sample=False, return_audio=True, speaker="Ethan")
