"""Audio preprocessing as transformers' WhisperFeatureExtractor does it for every omni family's audio encoder: log-mel
features of a clip padded to 30 s, the valid frames kept (one per hop started: Qwen2.5-Omni's processor), or of the
clip alone (`audio_padding: "longest"`, one frame per whole hop: Qwen3-Omni's processor).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omni.errors import RequestError
from omni.messages import MultiModalInput

from stages.common.media import check_audio
from stages.common.mm_items import MMItem, mm_hash

WHISPER_HOP = 160  # samples per mel frame of WhisperFeatureExtractor (its hop_length)

_FEATURE_EXTRACTORS: dict[int, Any] = {}


def _feature_extractor(cfg: dict[str, Any]) -> Any:
    from transformers import WhisperFeatureExtractor

    fe = _FEATURE_EXTRACTORS.get(cfg["num_mel_bins"])
    if fe is None:
        fe = _FEATURE_EXTRACTORS[cfg["num_mel_bins"]] = WhisperFeatureExtractor(
            feature_size=cfg["num_mel_bins"], sampling_rate=cfg["audio_sampling_rate"], return_attention_mask=True)
    return fe


def checked_audio(wave: np.ndarray, sampling_rate: int | None, cfg: dict[str, Any],
                  where: str = "multi_modal_data.audio") -> np.ndarray:
    """The waveform as the encoder takes it (mono float32 at the model's rate, one Whisper window of
    n_fft samples up to 30 s), or the RequestError naming what is wrong."""
    sr = cfg["audio_sampling_rate"]
    # one Whisper window (n_fft) at least
    wave = check_audio(wave, sampling_rate, sr, 400, where)
    limit = _feature_extractor(cfg).n_samples
    # The encoder sees one window (30 s): the extractor would silently drop the rest, so longer audio is
    # refused, by its length alone, before any copy or mel frame of it is made.
    if wave.shape[0] > limit:
        raise RequestError(f"{where}: {wave.shape[0] / sr:g} s of audio ({wave.shape[0]} samples at {sr} Hz), "
                           f"longer than the {limit / sr:g} s ({limit} samples) the audio encoder takes; "
                           "send it as several clips", field=where)
    return wave.astype(np.float32)


def audio_frames(wave: np.ndarray, cfg: dict[str, Any] | None = None) -> int:
    """Valid log-mel frames of a checked clip (the extractor's attention mask: one per hop started when padded to
    30 s, one per whole hop for the clip alone)."""
    if (cfg or {}).get("audio_padding", "max_length") == "longest":
        return wave.shape[0] // WHISPER_HOP
    return -(-wave.shape[0] // WHISPER_HOP)


def audio_features(wave: np.ndarray, cfg: dict[str, Any]) -> torch.Tensor:
    """A checked clip -> log-mel features [mel, valid frames], as transformers' processor makes them."""
    fe = _feature_extractor(cfg)
    padding = cfg.get("audio_padding", "max_length")
    out = fe(wave, sampling_rate=cfg["audio_sampling_rate"], padding=padding, truncation=padding == "max_length",
             return_attention_mask=True, return_tensors="np")
    n = int(out["attention_mask"][0].sum())
    return torch.from_numpy(out["input_features"][0, :, :n].copy())


def preprocess_audio(wave: np.ndarray, sampling_rate: int | None, cfg: dict[str, Any],
                     where: str = "multi_modal_data.audio") -> torch.Tensor:
    """Waveform (mono, at the model's sampling rate) -> log-mel features [mel, valid frames]."""
    return audio_features(checked_audio(wave, sampling_rate, cfg, where), cfg)


def audio_item(inp: MultiModalInput, cfg: dict[str, Any], num_tokens: Callable[[int], int], where: str) -> MMItem:
    """An audio input checked now, its features made when the encoder reads them (MMItem)."""
    wave = checked_audio(inp.data, inp.sampling_rate, cfg, where)
    frames = audio_frames(wave, cfg)
    return MMItem("audio", mm_hash(inp), num_tokens(frames), None, frames=frames,
                  _make=functools.partial(audio_features, wave, cfg))
