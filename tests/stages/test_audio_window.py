"""Qwen2.5-Omni's audio encoder takes one 30 s window: longer audio is refused, naming the item and the
limit, before any mel frame is computed (the feature extractor would drop the rest without a word)."""
from __future__ import annotations

import numpy as np
import pytest

from stages.qwen2_5_omni_inputs import PREPROCESS_DEFAULTS, audio_num_tokens, preprocess_audio

RATE = 16000


def test_audio_past_the_encoder_window_is_refused():
    cfg = dict(PREPROCESS_DEFAULTS)
    feats = preprocess_audio(np.zeros(30 * RATE, np.float32), RATE, cfg, "multi_modal_data.audio[0]")
    assert feats.shape == (128, 3000) and audio_num_tokens(feats.shape[1]) == 750  # the whole window
    with pytest.raises(ValueError) as e:
        preprocess_audio(np.zeros(30 * RATE + 1, np.float32), RATE, cfg, "multi_modal_data.audio[1]")
    msg = str(e.value)
    assert msg.startswith("multi_modal_data.audio[1]: ") and "480001 samples" in msg and "30 s" in msg, msg
