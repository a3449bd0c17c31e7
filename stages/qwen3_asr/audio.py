"""A Qwen3-ASR clip as its encoder takes it: `Qwen3ASRFeatureExtractor` on the clip alone, as
`Qwen3ASRProcessor` calls it (padding=True: a clip alone is not padded, but one shorter than the extractor's
`min_length` is zero-padded to it first), the mel axis padded to whole encoder chunks of 2 * n_window frames, and
transformers' `_get_feat_extract_output_lengths` for its number of encoder rows (placeholder tokens).

The encoder reads the clip in any length (its attention runs over windows of n_window_infer frames): the bound is
the model's positions, not a 30 s window.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from omni.errors import RequestError
from omni.messages import MultiModalInput

from stages.common.media import check_audio
from stages.common.mm_items import MMItem, mm_hash


def features(wave: np.ndarray, extractor: Any, n_window: int) -> torch.Tensor:
    """A checked clip -> log-mel features [mel, frames padded to whole chunks] (the valid ones: MMItem.frames)."""
    out = extractor(wave, sampling_rate=extractor.sampling_rate, padding=True, return_attention_mask=True,
                    n_window=n_window, return_tensors="np")
    return torch.from_numpy(out["input_features"][0].copy())


def valid_frames(num_samples: int, extractor: Any) -> int:
    """The extractor's attention mask's count: one frame per whole hop of the clip padded to min_length."""
    return max(num_samples, extractor.min_length) // extractor.hop_length


def audio_item(inp: MultiModalInput, extractor: Any, n_window: int, max_model_len: int, where: str) -> MMItem:
    """An audio input checked now, its features made when the encoder first reads them."""
    from transformers.models.qwen3_asr.modeling_qwen3_asr import _get_feat_extract_output_lengths

    if inp.modality != "audio":
        raise RequestError(f"{where}: Qwen3-ASR hears audio only, not {inp.modality}", field=where)
    rate = extractor.sampling_rate
    wave = check_audio(inp.data, inp.sampling_rate, rate, 1, where).astype(np.float32)
    frames = valid_frames(wave.shape[0], extractor)
    num_tokens = int(_get_feat_extract_output_lengths(torch.tensor(frames), n_window))
    if num_tokens > max_model_len:
        raise RequestError(f"{where}: {wave.shape[0] / rate:g} s of audio take {num_tokens} placeholder tokens, "
                           f"more than the model's {max_model_len} positions", field=where,
                           limit=max_model_len, actual=num_tokens)
    return MMItem("audio", mm_hash(inp), num_tokens, None, frames=frames,
                  _make=functools.partial(features, wave, extractor, n_window))
