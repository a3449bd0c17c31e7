"""Higgs Audio v2's codebook delay pattern: the layout of audio frames in the prompt, its inverse, and the per-request
state of transformers' `HiggsAudioV2DelayPatternLogitsProcessor` during generation.

An audio item of T codec frames with K codebooks is laid out as T + K + 1 model positions: a column of stream-bos
codes, the codes, a column of stream-eos codes, each codebook k shifted right by k positions (stream-bos before it,
stream-eos after it). Its placeholder text is `<|AUDIO_OUT|>` x (T + 2) then `<|reserved_special_token_6|>` (the
delay token) x (K - 1), as `HiggsAudioV2Processor` writes it. Generation makes frames in the same layout: step 0
is all stream-bos, codebook k starts k steps later, and once codebook 0 ends the others end one step apart.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def build_delay_pattern(codes: np.ndarray, bos: int, eos: int) -> np.ndarray:
    """[K, T] codec codes -> [T + K + 1, K] model frames (HiggsAudioV2Processor: bos/eos columns added, then
    `build_delay_pattern`)."""
    k, t = codes.shape
    cols = t + 2
    out = np.empty((k, cols + k - 1), dtype=np.int64)
    for i in range(k):
        out[i, :i + 1] = bos
        out[i, i + 1:i + 1 + t] = codes[i]
        out[i, i + 1 + t:] = eos
    return out.T.copy()


def revert_delay_pattern(frames: np.ndarray) -> np.ndarray:
    """[N, K] delayed frames -> [N - K + 1, K] aligned codec frames (HiggsAudioV2Processor.revert_delay_pattern)."""
    n, k = frames.shape
    return np.stack([frames[i:n - k + 1 + i, i] for i in range(k)], axis=1)


def audio_placeholders(num_frames: int, num_codebooks: int, audio_token: str, delay_token: str) -> str:
    """The text an audio item of `num_frames` model frames stands for (HiggsAudioV2Processor.get_audio_tokens)."""
    return audio_token * (num_frames - (num_codebooks - 1)) + delay_token * (num_codebooks - 1)


@dataclass(frozen=True, slots=True)
class AudioIds:
    """The token ids the delay pattern reads and writes."""

    audio_token: int  # <|AUDIO_OUT|>: an audio position
    delay_token: int  # an audio position after codebook 0 ended (and the processor's trailing K - 1)
    audio_bos: int  # <|audio_out_bos|>: the generation prompt's last token
    eos_token: int  # ends the request: every codebook produced stream-eos
    stream_bos: int  # code 1024: a codebook not started yet
    stream_eos: int  # code 1025: a codebook that ended
    num_codebooks: int
    codebook_size: int


class DelayState:
    """One request's HiggsAudioV2DelayPatternLogitsProcessor: started from the prompt's last K ids, then stepped
    once per sampled frame with the request's previous token (transformers' `input_ids[:, -1]`)."""

    __slots__ = ("ids", "bos_left", "eos_left")

    def __init__(self, ids: AudioIds, prompt_tail: list[int]):
        self.ids = ids
        k = ids.num_codebooks
        pattern = np.arange(1, k + 1, dtype=np.int64)
        window = list(prompt_tail[-k:])
        self.bos_left = pattern - (k - window.index(ids.audio_bos)) if ids.audio_bos in window \
            else np.zeros(k, dtype=np.int64)
        self.eos_left = pattern - (k - window.index(ids.delay_token)) if ids.delay_token in window \
            else pattern.copy()

    def mask(self, scores: torch.Tensor, last_token: int) -> torch.Tensor:
        """[K, C] code logits of one step -> the same with the forced codebooks' other codes at -inf."""
        ids = self.ids
        forced_bos = torch.from_numpy(self.bos_left >= 0)
        self.bos_left[self.bos_left >= 0] -= 1
        if last_token == ids.delay_token:
            self.eos_left -= 1
        forced_eos = torch.from_numpy(self.eos_left <= 0)
        codes = torch.arange(ids.codebook_size)
        out = scores.clone()
        out[forced_bos[:, None] & (codes != ids.stream_bos)[None, :]] = float("-inf")
        out[forced_eos[:, None] & (codes != ids.stream_eos)[None, :]] = float("-inf")
        return out


def next_token(ids: AudioIds, frame: list[int], last_token: int) -> int:
    """The token a sampled frame stands for (transformers' `next_tokens_flat`): the audio token; the delay token
    once a codebook ended (or after a delay token); the eos token when every codebook ended."""
    ended = [c == ids.stream_eos for c in frame]
    if all(ended):
        return ids.eos_token
    if any(ended) or last_token == ids.delay_token:
        return ids.delay_token
    return ids.audio_token
