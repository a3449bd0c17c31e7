"""The thinker's preprocessing equals transformers' Qwen2_5OmniProcessor: pixel values, image grids,
audio features and the expanded prompt ids, for the same prompt text, images and audio."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omni.messages import MultiModalInput, StageInput
from tests.stages.omni_utils import audio, image

pytest.importorskip("PIL")


def _reference_processor(thinker_stage):
    """transformers' Qwen2_5OmniProcessor with our checkpoint's tokenizer, the Pillow image processor
    and a Whisper feature extractor of the checkpoint's mel size.

    Its constructor insists on a video processor class, which needs torchvision (not installed and not
    needed: these prompts hold no video); skipping that class check is the only change, every method that
    turns text, images and audio into model inputs is transformers' own."""
    from transformers import Qwen2_5OmniProcessor, WhisperFeatureExtractor

    from stages.common.images import hf_image_processor

    class NoVideoProcessor(Qwen2_5OmniProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None

    cfg = thinker_stage.preprocess_cfg
    image_processor = hf_image_processor(cfg)
    assert image_processor is not None, "Pillow is installed, so the Pillow image processor must be used"
    features = WhisperFeatureExtractor(feature_size=cfg["num_mel_bins"], sampling_rate=cfg["audio_sampling_rate"])
    return NoVideoProcessor(image_processor=image_processor, feature_extractor=features,
                            tokenizer=thinker_stage.tokenizer)


def _ours(thinker_stage, prompt, mm):
    prepared = thinker_stage.preprocess(StageInput("r", prompt=prompt, mm_inputs=mm))
    return prepared.token_ids, prepared.extra["thinker"].items


def _rendered(thinker_stage, prompt, mm) -> str:
    from stages.qwen2_5_omni.inputs import messages_for, render_chat

    return render_chat(messages_for(prompt, [m.modality for m in mm]), thinker_stage.preprocess_cfg["system_prompt"])


@pytest.mark.parametrize("shape", [(56, 84), (61, 93), (300, 97), (17, 29)])
def test_image_pixels_and_prompt_ids_equal_the_processor(thinker_stage, shape):
    img = image(3, *shape)
    mm = [MultiModalInput("image", img)]
    ids, items = _ours(thinker_stage, "What is in this picture?", mm)
    ref = _reference_processor(thinker_stage)(
        text=[_rendered(thinker_stage, "What is in this picture?", mm)], images=[img], return_tensors="pt")
    assert ids == ref["input_ids"][0].tolist()
    assert torch.equal(items[0].grid_thw, ref["image_grid_thw"][0])
    assert items[0].data.dtype == torch.float32
    assert torch.equal(items[0].data, ref["pixel_values"].float())


def test_two_images_and_audio_in_one_chat_equal_the_processor(thinker_stage):
    imgs = [image(4, 56, 84), image(5, 120, 64)]
    wave = audio(1, 2.5)
    mm = [MultiModalInput("image", imgs[0]), MultiModalInput("audio", wave, 16000),
          MultiModalInput("image", imgs[1])]
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this sound"},
                                         {"type": "audio"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    ids, items = _ours(thinker_stage, chat, mm)
    ref = _reference_processor(thinker_stage)(
        text=[_rendered(thinker_stage, chat, mm)], images=imgs, audio=[wave], return_tensors="pt")
    assert ids == ref["input_ids"][0].tolist()
    ours_images = [i for i in items if i.modality == "image"]
    assert torch.equal(torch.cat([i.data for i in ours_images]), ref["pixel_values"].float())
    assert torch.equal(torch.stack([i.grid_thw for i in ours_images]), ref["image_grid_thw"])
    (ours_audio,) = [i for i in items if i.modality == "audio"]
    valid = int(ref["feature_attention_mask"][0].sum())
    assert ours_audio.data.shape[1] == valid
    # The same WhisperFeatureExtractor code on the same float32 samples: bitwise.
    np.testing.assert_array_equal(ours_audio.data.numpy(), ref["input_features"][0, :, :valid].numpy())


def test_grey_and_rgba_images_become_the_rgb_image_the_processor_sees(thinker_stage):
    """Our input contract also takes HxW grey and HxWx4 arrays: they are the RGB image with the grey
    value repeated / the alpha channel dropped, then go through the same processor."""
    rgb = image(6, 56, 84)
    rgba = np.concatenate([rgb, np.full(rgb.shape[:2] + (1,), 7, np.uint8)], axis=-1)
    grey = rgb[..., 0]
    _, (from_rgba,) = _ours(thinker_stage, "x", [MultiModalInput("image", rgba)])
    _, (from_rgb,) = _ours(thinker_stage, "x", [MultiModalInput("image", rgb)])
    _, (from_grey,) = _ours(thinker_stage, "x", [MultiModalInput("image", grey)])
    _, (from_grey_rgb,) = _ours(thinker_stage, "x", [MultiModalInput("image", np.repeat(grey[..., None], 3, -1))])
    assert torch.equal(from_rgba.data, from_rgb.data)
    assert torch.equal(from_grey.data, from_grey_rgb.data)


def test_audio_features_are_made_only_when_the_encoder_reads_them(thinker_stage):
    """A clip's log-mel features wait for the encoder (MMItem.data): a conversation that re-sends a clip whose
    rows the encoder cache holds never computes them again, and the ones made late equal the processor's."""
    wave = audio(2, 1.5)
    chat = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "what is this?"}]}]
    mm = [MultiModalInput("audio", wave, 16000)]
    _, (first,) = _ours(thinker_stage, chat, mm)
    assert first._data is None and first.frames == -(-wave.shape[0] // 160)  # known from the length
    rows = thinker_stage.encode(first)[0]  # a miss: the features are made now
    ref = _reference_processor(thinker_stage)(text=[_rendered(thinker_stage, chat, mm)], audio=[wave],
                                              return_tensors="pt")
    valid = int(ref["feature_attention_mask"][0].sum())
    assert first.frames == valid
    np.testing.assert_array_equal(first.data.numpy(), ref["input_features"][0, :, :valid].numpy())
    _, (again,) = _ours(thinker_stage, chat, mm)
    assert torch.equal(thinker_stage.encode(again)[0], rows)  # the encoder cache's rows
    assert again._data is None  # never computed
