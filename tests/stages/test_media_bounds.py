"""Qwen2.5-Omni's media bounds, checked from an input's shape before anything is computed from it:
audio past the encoder's 30 s window is refused (the feature extractor would drop the rest without a
word), and a prompt whose media alone take more placeholder tokens than the model has positions is
refused before any pixel value is made. Both name the item and the limit."""
from __future__ import annotations

import time

import numpy as np
import pytest

from omni.errors import ContextLengthError
from omni.messages import MultiModalInput, StageInput
from stages.common.audio_features import preprocess_audio
from stages.qwen2_5_omni.inputs import (PREPROCESS_DEFAULTS, audio_num_tokens, load_preprocess_config, mm_num_tokens,
                                        preprocess_mm)

RATE = 16000


def test_audio_past_the_encoder_window_is_refused():
    cfg = dict(PREPROCESS_DEFAULTS)
    feats = preprocess_audio(np.zeros(30 * RATE, np.float32), RATE, cfg, "multi_modal_data.audio[0]")
    assert feats.shape == (128, 3000) and audio_num_tokens(feats.shape[1]) == 750  # the whole window
    with pytest.raises(ValueError) as e:
        preprocess_audio(np.zeros(30 * RATE + 1, np.float32), RATE, cfg, "multi_modal_data.audio[1]")
    msg = str(e.value)
    assert msg.startswith("multi_modal_data.audio[1]: ") and "480001 samples" in msg and "30 s" in msg, msg


def test_token_count_from_the_shape_equals_the_preprocessed_one(tiny_omni):
    rng = np.random.default_rng(0)
    for cfg in (dict(PREPROCESS_DEFAULTS), load_preprocess_config(tiny_omni)):
        for h, w in [(1, 1), (28, 28), (56, 84), (100, 37), (500, 700), (1000, 30)]:
            inp = MultiModalInput("image", rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            assert mm_num_tokens(inp, cfg) == preprocess_mm(inp, cfg).num_tokens, (h, w)
        for n in [400, 401, 16000, 16159, 16160, 16161, 30 * RATE]:
            inp = MultiModalInput("audio", np.zeros(n, np.float32), RATE)
            assert mm_num_tokens(inp, cfg) == preprocess_mm(inp, cfg).num_tokens, n


def test_media_past_the_model_positions_are_refused_before_preprocessing(thinker_stage):
    cfg = thinker_stage.preprocess_cfg
    big = np.zeros((448, 448, 3), np.uint8)
    per_image = mm_num_tokens(MultiModalInput("image", big), cfg)
    n = thinker_stage.max_model_len // per_image + 1  # one image more than the model's positions hold
    inp = StageInput("r", prompt="Describe them.", mm_inputs=[MultiModalInput("image", big)] * n)
    t0 = time.monotonic()
    with pytest.raises(ContextLengthError) as e:  # the caller's fault (a 400), not the stage's
        thinker_stage.preprocess(inp)
    assert time.monotonic() - t0 < 1.0  # no image was preprocessed
    assert e.value.field == f"multi_modal_data.image[{n - 1}]" and e.value.actual == per_image * n
    msg = str(e.value)
    assert msg.startswith(f"multi_modal_data.image[{n - 1}]: ") and f"{per_image * n} placeholder tokens" in msg
    assert f"{thinker_stage.max_model_len} positions" in msg, msg
