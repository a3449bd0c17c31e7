"""Our video path (PyAV decoding, torch frame sampling and preprocessing, the placeholder layout with and without the
audio track) equals transformers' Qwen2_5OmniProcessor / Qwen3OmniMoeProcessor on the committed videos, bit for bit:
their outputs were computed once in an environment with torchvision (tests/data/make_video_reference.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stages.common.video import preprocess_video, sample_indices
from stages.common.video_decode import VideoLimits, decode_audio_track, decode_frames, probe_video
from tests.stages.video_utils import CLIPS, clip_bytes, reference, sha, video_request


def _settings(family: str) -> dict:
    if family == "q25":
        from stages.qwen2_5_omni.inputs import PREPROCESS_DEFAULTS, video_settings_of

        return video_settings_of(PREPROCESS_DEFAULTS)
    from stages.qwen3_omni.inputs import image_config, video_settings_of

    vision = SimpleNamespace(patch_size=16, temporal_patch_size=2, spatial_merge_size=2)  # the 30B model's
    return video_settings_of(image_config(vision, 12845056))


@pytest.mark.parametrize("name", CLIPS)
def test_decoding_equals_the_reference_decoding(name):
    ref, data = reference(), clip_bytes(name).tobytes()
    info = probe_video(data, "v", VideoLimits())
    assert (info.frames, info.height, info.width, 3) == tuple(ref[f"{name}.frames_shape"])
    assert info.fps == float(ref[f"{name}.fps"])
    assert sha(decode_frames(data, list(range(info.frames)), "v")) == str(ref[f"{name}.frames_sha"])
    wave = decode_audio_track(data, 16000, "v", VideoLimits())
    assert info.has_audio == (wave is not None) == (f"{name}.wave_sha" in ref)
    if wave is not None:
        assert wave.dtype == np.float32 and wave.shape == (int(ref[f"{name}.wave_len"]),)
        assert sha(wave) == str(ref[f"{name}.wave_sha"])


@pytest.mark.parametrize("family", ["q25", "q3"])
@pytest.mark.parametrize("name", CLIPS)
def test_sampled_frames_and_pixel_values_equal_the_video_processor(family, name):
    ref, data, cfg = reference(), clip_bytes(name).tobytes(), _settings(family)
    key = f"{family}.{name}.v"
    info = probe_video(data, "v", VideoLimits())
    indices = sample_indices(info.frames, info.fps, cfg, "v")
    assert indices == ref[f"{key}.frames_indices"].tolist()
    pixels, grid = preprocess_video(decode_frames(data, indices, "v"), cfg, "v")
    assert grid.tolist() == ref[f"{key}.grid"].tolist()
    assert pixels.dtype == torch.float32 and list(pixels.shape) == ref[f"{key}.pixels_shape"].tolist()
    np.testing.assert_array_equal(pixels.numpy()[[0, pixels.shape[0] // 2, -1]], ref[f"{key}.pixels_rows"])
    assert sha(pixels.numpy()) == str(ref[f"{key}.pixels_sha"])
    assert [cfg["temporal_patch_size"] / cfg["fps"]] == ref[f"{key}.second_per_grid"].tolist()


def _thinker(family: str, request):
    if family == "q25":
        return request.getfixturevalue("thinker_stage")
    from tests.stages.qwen3_omni_utils import stages

    return stages("tiny")[0]


@pytest.mark.parametrize("family", ["q25", "q3"])
@pytest.mark.parametrize("name,with_audio", [("plain", False), ("talk", False), ("talk", True), ("long", True)])
def test_prompt_ids_and_track_features_equal_the_processor(family, name, with_audio, request):
    """The whole item: the prompt ids with the video's placeholders expanded (the track's interleaved by time with
    use_audio_in_video: in 2 s chunks for Qwen2.5-Omni, merged for Qwen3-Omni), its pixel values, and the track's
    log-mel features as the family's processor makes them (padded to 30 s / not padded)."""
    ref, stage = reference(), _thinker(family, request)
    key = f"{family}.{name}.{'av' if with_audio else 'v'}"
    inp = video_request("r", name, with_audio)
    assert stage.render_prompt(inp, [SimpleNamespace(modality="video")]) == str(ref[f"prompt.{family}"])
    prepared = stage.preprocess(inp)
    assert prepared.token_ids == ref[f"{key}.input_ids"].tolist()
    (item,) = prepared.extra["thinker"].items
    assert sha(item.data.numpy()) == str(ref[f"{key}.pixels_sha"])
    assert item.grid_thw.tolist() == ref[f"{key}.grid"].tolist()
    assert [item.second_per_grid] == ref[f"{key}.second_per_grid"].tolist()
    assert (item.audio is not None) == with_audio
    if with_audio:
        assert item.audio.frames == int(ref[f"{key}.audio_frames"])
        np.testing.assert_array_equal(item.audio.data.numpy()[:, [0, item.audio.frames // 2, -1]],
                                      ref[f"{key}.features_cols"])
        assert sha(item.audio.data.numpy()) == str(ref[f"{key}.features_sha"])
        # the run between the audio bos/eos tokens is the item's encoder rows, as the block hashes see them
        assert prepared.token_ids[item.offset - 1] == stage.video_spec.audio_bos
        assert prepared.token_ids[item.offset + item.num_tokens] == stage.video_spec.audio_eos
    (feature,) = prepared.mm_features
    assert (feature.offset, feature.length, feature.modality) == (item.offset, item.num_tokens, "video")
