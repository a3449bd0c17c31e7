"""Band-limited resampling equal to `torchaudio.functional.resample` with its defaults, in plain torch.

Models trained on features of torchaudio's resampler (Higgs Audio v2's codec resamples 24 kHz input to
16 kHz for its HuBERT) must see the same samples, and torchaudio does not load beside the project's torch.
This is its windowed-sinc method (`sinc_interp_hann`, lowpass_filter_width 6, rolloff 0.99): the same
kernel computed in the waveform's dtype with the same operations in the same order, applied as the same
strided convolution, so the output equals torchaudio's to the convolution's rounding.

The kernel: for each of the `new` output phases (rates reduced by their gcd), a Hann-windowed sinc
sampled at the input positions around it, its cutoff at `rolloff` times the lower of the two Nyquist rates.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99


@lru_cache(maxsize=8)
def _kernel(orig: int, new: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
    """([new, 1, taps] kernel, width): rates already reduced by their gcd."""
    base = min(orig, new) * ROLLOFF
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / base)
    idx = torch.arange(-width, width + orig, dtype=dtype, device=device)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=dtype, device=device)[:, None, None] / new + idx
    t *= base
    t = t.clamp_(-LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = torch.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t *= math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernel *= window * (base / orig)
    return kernel, width


def resampled_length(length: int, orig_freq: int, new_freq: int) -> int:
    """Samples that resample() returns for `length` input samples: ceil(length * new / orig), the ratio
    rounded to float32 first as torchaudio's `torch.as_tensor` does."""
    g = math.gcd(orig_freq, new_freq)
    return math.ceil(float(torch.tensor((new_freq // g) * length / (orig_freq // g), dtype=torch.float32)))


def resample(wave: torch.Tensor, orig_freq: int, new_freq: int) -> torch.Tensor:
    """[..., time] float waveform at `orig_freq` Hz -> [..., resampled_length] at `new_freq` Hz."""
    if not wave.is_floating_point():
        raise TypeError(f"resample: expected a floating-point waveform, got {wave.dtype}")
    if orig_freq <= 0 or new_freq <= 0:
        raise ValueError(f"resample: rates must be positive, got {orig_freq} -> {new_freq}")
    if orig_freq == new_freq:
        return wave
    g = math.gcd(orig_freq, new_freq)
    orig, new = orig_freq // g, new_freq // g
    kernel, width = _kernel(orig, new, wave.dtype, wave.device)
    shape = wave.shape
    flat = F.pad(wave.reshape(-1, shape[-1]), (width, width + orig))
    out = F.conv1d(flat[:, None], kernel, stride=orig).transpose(1, 2).reshape(flat.shape[0], -1)
    return out[:, : resampled_length(shape[-1], orig_freq, new_freq)].reshape(*shape[:-1], -1)
