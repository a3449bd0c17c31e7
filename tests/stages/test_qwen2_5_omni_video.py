"""Qwen2.5-Omni's thinker with videos vs transformers' generate fed the same tensors (with and without the audio
track interleaved, prefix caching on and off); videos in the block hashes and the encoder cache; the forms a video
may take; limits and bad requests named."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from omni.errors import ContextLengthError, RequestError
from omni.messages import MultiModalInput, StageInput
from omni.sampling_params import SamplingParams
from stages.common.video_decode import VideoLimits, decode_audio_track, decode_frames
from tests.engine_utils import assert_no_leak, make_engine, run_to_completion
from tests.stages.omni_utils import THINKER_MAX, hf_generate, hf_inputs, thinker_atol
from tests.stages.video_utils import QUESTION, clip_bytes, video_request
from tests.tolerances import assert_rows_close

GREEDY = SamplingParams(temperature=0.0, max_tokens=THINKER_MAX)


def _run(engine, inputs):
    for inp in inputs:
        engine.add_request(inp)
    return run_to_completion(engine)


def _fresh(stage):
    stage.encoder_cache.clear()
    stage.encoder_cache.runs = stage.encoder_cache.hits = 0
    return stage


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("name,with_audio", [("plain", False), ("talk", True), ("long", True)])
def test_thinker_with_a_video_matches_transformers_generate(thinker_stage, hf_omni, name, with_audio, caching):
    """Chunked (64 tokens a step) so the video's rows straddle steps; transformers computes its 3-D positions
    itself (TMRoPE: the track's rows interleaved with the frames' by time in 2 s chunks)."""
    stage = _fresh(thinker_stage)
    engine = make_engine(None, model=stage, block_size=4, max_num_batched_tokens=64, caching=caching)
    inp = video_request(name, name, with_audio, sampling_params=GREEDY)
    out = _run(engine, [inp])[name]
    ids, kw = hf_inputs(stage, inp)
    assert kw["use_audio_in_video"] == with_audio and ("input_features" in kw) == with_audio
    ref, _, _ = hf_generate(hf_omni, ids, kw, audio_out=False)
    assert out.prompt_token_ids == ids
    assert out.token_ids == ref
    pos, _ = stage.rope_index(ids, stage.preprocess(inp).extra["thinker"].items)
    np.testing.assert_array_equal(out.mm_outputs["mrope_positions"][: len(ids)], pos.t().numpy())
    assert stage.encoder_cache.runs == 1  # the video (with its track): one item, encoded once
    assert_no_leak(engine)


def test_videos_share_blocks_only_before_them_and_a_resent_video_hits_both_caches(thinker_stage):
    stage = _fresh(thinker_stage)
    engine = make_engine(None, model=stage, block_size=4)
    a = video_request("a", "plain", False, sampling_params=GREEDY)
    b = video_request("b", "talk", False, sampling_params=GREEDY)
    pa, pb = stage.preprocess(a), stage.preprocess(b)
    assert pa.token_ids == pb.token_ids  # the same placeholders: only the videos differ
    out_a, out_b = _run(engine, [a])["a"], _run(engine, [b])["b"]
    offset = pa.mm_features[0].offset
    assert 0 < out_b.num_cached_tokens <= offset  # only the text blocks before the video are shared
    ref = _run(make_engine(None, model=stage, block_size=4, caching=False), [dataclasses.replace(b)])["b"]
    assert out_b.token_ids == ref.token_ids
    atol = thinker_atol(ref.hidden_states)
    assert_rows_close(out_b.hidden_states, ref.hidden_states, atol)
    n = min(len(out_a.hidden_states), len(out_b.hidden_states))
    assert np.abs(out_a.hidden_states[offset:n] - out_b.hidden_states[offset:n]).max() > atol
    # The same video with its track is another item (other rows, other placeholders): no block of it is shared.
    c = video_request("c", "talk", True, sampling_params=GREEDY)
    assert stage.preprocess(c).mm_features[0].mm_hash != pb.mm_features[0].mm_hash
    assert _run(engine, [c])["c"].num_cached_tokens <= offset
    # The first video again with another question: its blocks hit and its rows come from the encoder cache.
    runs = stage.encoder_cache.runs
    again = video_request("again", "plain", False, sampling_params=GREEDY,
                          prompt=[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Why?"}]}])
    out = _run(engine, [again])["again"]
    assert out.num_cached_tokens >= offset + pa.mm_features[0].length - 4
    assert stage.encoder_cache.runs == runs
    assert_no_leak(engine)


def test_frames_with_their_rate_are_taken_as_the_file_and_a_given_track_as_the_decoded_one(thinker_stage):
    stage = thinker_stage
    data = clip_bytes("talk").tobytes()
    frames = decode_frames(data, list(range(14)), "v")  # talk.mp4: 14 frames at 5 fps
    from_file = stage.preprocess(video_request("f", "talk", False))
    from_frames = stage.preprocess(StageInput("a", prompt=QUESTION,
                                              mm_inputs=[MultiModalInput("video", frames, fps=5.0)]))
    assert from_frames.token_ids == from_file.token_ids
    assert (from_frames.extra["thinker"].items[0].data == from_file.extra["thinker"].items[0].data).all()
    # Without a rate every frame is taken (as sampled at the model's 2 fps): 14 frames, 7 temporal patches.
    bare = stage.preprocess(StageInput("b", prompt=QUESTION, mm_inputs=[MultiModalInput("video", frames)]))
    assert bare.extra["thinker"].items[0].grid_thw.tolist()[0] == 7
    # vLLM's way: the track under multi_modal_data.audio, one per video
    track = decode_audio_track(data, 16000, "v", VideoLimits())
    given = stage.preprocess(StageInput("t", prompt=QUESTION, mm_processor_kwargs={"use_audio_in_video": True},
                                        mm_inputs=[MultiModalInput("video", clip_bytes("talk")),
                                                   MultiModalInput("audio", track, 16000)]))
    decoded = stage.preprocess(video_request("d", "talk", True))
    assert given.token_ids == decoded.token_ids
    assert given.mm_features[0].mm_hash == decoded.mm_features[0].mm_hash


def _limited(stage, **limits):
    return dataclasses.replace(stage.video_spec, limits=VideoLimits(**limits))


@pytest.mark.parametrize("limits,match", [
    (dict(max_bytes=1000), r"multi_modal_data.video\[0\]: \d+ bytes of video, more than the limit of 1000"),
    (dict(max_frames=10), r"multi_modal_data.video\[0\]: 14 frames, more than the limit of 10"),
    (dict(max_seconds=2.0), r"multi_modal_data.video\[0\]: 2.8 s of video \(14 frames at 5 fps\), longer than "
                            r"the limit of 2 s"),
    (dict(max_pixels=1000), r"multi_modal_data.video\[0\]: 52x36 frames \(1872 pixels\), more than the limit of "
                            r"1000 pixels per frame"),
])
def test_video_limits_name_the_field_and_the_numbers(thinker_stage, limits, match):
    spec = thinker_stage.video_spec
    thinker_stage.video_spec = _limited(thinker_stage, **limits)
    try:
        with pytest.raises(RequestError, match=match) as e:
            thinker_stage.preprocess(video_request("r", "talk", False))
        assert e.value.field == "multi_modal_data.video[0]"
    finally:
        thinker_stage.video_spec = spec


def test_bad_video_requests_are_named(thinker_stage):
    stage = thinker_stage
    with pytest.raises(RequestError, match=r"video\[0\]: use_audio_in_video needs the video's audio track"):
        stage.preprocess(video_request("r", "plain", True))
    with pytest.raises(RequestError, match="mm_processor_kwargs.fps: not a setting") as e:
        stage.preprocess(StageInput("r", prompt=QUESTION, mm_inputs=[MultiModalInput("video", clip_bytes("plain"))],
                                    mm_processor_kwargs={"fps": 4}))
    assert e.value.field == "mm_processor_kwargs.fps"
    with pytest.raises(RequestError, match="use_audio_in_video: expected true or false"):
        stage.preprocess(video_request("r", "plain", "yes"))  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=r"audio inputs are the videos' tracks, one per video: got 2 for 1"):
        stage.preprocess(StageInput("r", prompt=QUESTION, mm_processor_kwargs={"use_audio_in_video": True},
                                    mm_inputs=[MultiModalInput("video", clip_bytes("talk")),
                                               MultiModalInput("audio", np.zeros(16000, np.float32), 16000),
                                               MultiModalInput("audio", np.zeros(16000, np.float32), 16000)]))
    with pytest.raises(RequestError, match=r"video\[0\]: not a readable video file"):
        stage.preprocess(StageInput("r", prompt=QUESTION,
                                    mm_inputs=[MultiModalInput("video", np.arange(99, dtype=np.uint8))]))
    with pytest.raises(RequestError, match=r"video\[0\]: 1 frame\(s\); a video needs at least 2"):
        stage.preprocess(StageInput("r", prompt=QUESTION,
                                    mm_inputs=[MultiModalInput("video", np.zeros((1, 8, 8, 3), np.uint8), fps=5.0)]))
    # without a rate the frames are taken as they are, the last repeated up to a temporal patch (transformers')
    one = stage.preprocess(StageInput("r", prompt=QUESTION,
                                      mm_inputs=[MultiModalInput("video", np.zeros((1, 8, 8, 3), np.uint8))]))
    assert one.extra["thinker"].items[0].grid_thw.tolist()[0] == 1
    with pytest.raises(RequestError, match=r"frames must be integers 0..255 \(uint8\), got float32"):
        stage.preprocess(StageInput("r", prompt=QUESTION,
                                    mm_inputs=[MultiModalInput("video", np.zeros((4, 8, 8, 3), np.float32))]))
    # 3840 frames at 10 fps sample 768 (the most), each upscaled to 336x336 (at least 128 merge patches):
    # 384 temporal patches of 144 tokens
    frames = np.zeros((768 * 5, 28, 28, 3), np.uint8)
    with pytest.raises(ContextLengthError, match=r"768 sampled frames of 28x28 take 55296 placeholder tokens"):
        stage.preprocess(StageInput("r", prompt=QUESTION, mm_inputs=[MultiModalInput("video", frames, fps=10.0)]))


@pytest.mark.slow
@pytest.mark.parametrize("name,with_audio", [("plain", False), ("talk", True)])
def test_pipeline_with_a_video_matches_transformers_generate(thinker_stage, talker_stage, token2wav_stage, hf_omni,
                                                             name, with_audio):
    """thinker -> talker -> token2wav with a video (the talker takes the thinker's 3-D positions, its video and
    track rows zeroed as transformers' talker input): the same text, codes and waveform, bit for bit."""
    from stages.qwen2_5_omni.edges import talker2wav
    from tests.stages.omni_utils import make_chain, run_chain

    inp = video_request(name, name, with_audio)
    thinker_out, talker_out, wav_out = run_chain(make_chain(thinker_stage, talker_stage, token2wav_stage), [inp])[name]
    ids, kw = hf_inputs(thinker_stage, inp)
    kw["talker_pixel_values_videos"] = None  # transformers forwards them to the talker, which rejects them
    ref_tokens, ref_codes, ref_wav = hf_generate(hf_omni, ids, kw, audio_out=True)
    assert thinker_out.token_ids == ref_tokens
    assert talker2wav({"talker": talker_out}, inp).prompt_token_ids == ref_codes
    np.testing.assert_array_equal(wav_out.audio, ref_wav)


def test_model_kwargs_set_the_frame_rate_and_the_limits(tiny_omni):
    """`video_fps` (the rate frames are sampled at; seconds per temporal patch follow it) and `video_limits`."""
    import torch

    from stages.qwen2_5_omni.thinker import Qwen2_5OmniThinkerStage

    stage = Qwen2_5OmniThinkerStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cpu"),
                                         model_kwargs={"video_fps": 4.0, "video_limits": {"max_seconds": 4}})
    (item,) = stage.preprocess(video_request("r", "talk", False)).extra["thinker"].items
    assert item.grid_thw.tolist()[0] == 5 and item.second_per_grid == 0.5  # 2.8 s at 4 fps: 10 frames
    with pytest.raises(RequestError, match=r"4.16667 s of video \(25 frames at 6 fps\), longer than the limit of 4 s"):
        stage.preprocess(video_request("r", "long", False))
    with pytest.raises(ValueError, match="model_kwargs.video_limits: unknown key 'max_minutes'"):
        Qwen2_5OmniThinkerStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cpu"),
                                     model_kwargs={"video_limits": {"max_minutes": 4}})
