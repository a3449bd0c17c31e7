"""Higgs Audio v2's audio codec (transformers' `HiggsAudioV2TokenizerModel`) without torchaudio.

    encode   24 kHz waveform [B, 1, N] -> codes [B, K, T] at the highest bandwidth (K = num_quantizers)
    decode   codes [B, K, T] -> 24 kHz waveform [B, 1, T * hop_length]

Encode joins two views of the audio frame by frame: a semantic one (the waveform resampled to 16 kHz with
torchaudio's resampler, 160 samples of zeros each side, the mean of all of HuBERT's hidden states, every
`semantic_downsample_factor`-th frame, the semantic encoder's convolutions) and an acoustic one (DAC's
encoder, on the waveform padded by half a hop each side when unpadded it would give another frame count);
`fc` mixes them and the residual quantizer codes the result. Decode sums the quantizers' vectors, projects
them with `fc2` and runs DAC's decoder (transformers adjusts it: output padding `stride % 2` on each
transposed convolution, so that T frames give exactly T * hop samples, and no final tanh).

The decoder is not causal (every convolution is centred), so a window of frames decodes the samples of its
middle exactly once it has enough context on both sides: `decode_window`.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from stages.common.resample import resample
from stages.higgs_audio_v2.codec_blocks import ResidualVectorQuantizer, SemanticDecoder, SemanticEncoder
from stages.higgs_audio_v2.codec_weights import match_keys, read_safetensors

SEMANTIC_PAD = 160  # samples at 16 kHz each side of HuBERT's input, as transformers pads (not hop / 2)


def codec_config_class():
    """transformers' HiggsAudioV2TokenizerConfig (its module imports no torchaudio, unlike the model's)."""
    from transformers.models.higgs_audio_v2_tokenizer.configuration_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerConfig,
    )

    return HiggsAudioV2TokenizerConfig


def adjust_dac_decoder(decoder: nn.Module) -> None:
    """Higgs' DAC decoder differs from transformers' DacDecoder: output padding `stride % 2` on every transposed
    convolution, and no tanh at the end."""
    for module in decoder.modules():
        if isinstance(module, nn.ConvTranspose1d):
            module.output_padding = (module.stride[0] % 2,)
    decoder.tanh = nn.Identity()


def _conv_length(conv: nn.Conv1d, length: int) -> int:
    # transformers' conv1d_output_length, truncating as it does
    return int((length + 2 * conv.padding[0] - conv.dilation[0] * (conv.kernel_size[0] - 1) - 1) / conv.stride[0] + 1)


class HiggsCodec(nn.Module):
    """The codec, its attribute names those of transformers' model (its checkpoints load key for key)."""

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.dac.modeling_dac import DacDecoder, DacEncoder

        self.config = config
        self.pad = config.hop_length // 2
        self.acoustic_encoder = DacEncoder(config.acoustic_model_config)
        self.acoustic_decoder = DacDecoder(config.acoustic_model_config)
        adjust_dac_decoder(self.acoustic_decoder)
        self.encoder_semantic = SemanticEncoder(config)
        self.decoder_semantic = SemanticDecoder(config)
        self.semantic_model = AutoModel.from_config(config.semantic_model_config).eval()
        self.fc = nn.Linear(config.hidden_size, config.hidden_size)
        self.fc1 = nn.Linear(config.hidden_size, config.semantic_model_config.hidden_size)  # training only
        self.fc2 = nn.Linear(config.hidden_size, config.acoustic_model_config.hidden_size)
        self.quantizer = ResidualVectorQuantizer(config)
        self._encoder_convs = [m for m in self.acoustic_encoder.modules() if isinstance(m, nn.Conv1d)]

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> HiggsCodec:
        """The codec of a directory as transformers' `save_pretrained` writes it (config.json, safetensors)."""
        directory = Path(directory)
        model = cls(codec_config_class().from_pretrained(str(directory)))
        model.load_state_dict(match_keys(read_safetensors(directory), set(model.state_dict())), strict=True)
        return model.to(device=device, dtype=dtype).eval()

    # -- facts ----------------------------------------------------------------
    @property
    def hop_length(self) -> int:
        """Samples per frame at `sample_rate`."""
        return int(self.config.hop_length)

    @property
    def sample_rate(self) -> int:
        return int(self.config.sample_rate)

    @property
    def num_quantizers(self) -> int:
        return len(self.quantizer.quantizers)

    @property
    def codebook_size(self) -> int:
        return int(self.config.codebook_size)

    def decoder_reach_frames(self) -> int:
        """Frames on each side of a frame whose codes can change its samples: the half-widths of the decoder's
        centred convolutions (a transposed one reaches ceil(kernel / stride) input samples), each in frames
        at its own rate, summed and rounded up. Context of this many frames makes a window exact."""
        reach, rate = 0.0, 1  # rate: samples per frame where the layer runs
        for m in self.acoustic_decoder.modules():
            if isinstance(m, nn.ConvTranspose1d):
                reach += math.ceil(m.kernel_size[0] / m.stride[0]) / rate
                rate *= m.stride[0]
            elif isinstance(m, nn.Conv1d):
                reach += m.dilation[0] * (m.kernel_size[0] - 1) / 2 / rate
        return math.ceil(reach)

    # -- encode ---------------------------------------------------------------
    def _semantic_features(self, wave: torch.Tensor) -> torch.Tensor:
        """[B, 1, N] at sample_rate -> [B, T, semantic hidden]: HuBERT's hidden states averaged."""
        cfg = self.config
        x = resample(wave[:, 0, :], cfg.sample_rate, cfg.semantic_sample_rate)
        x = F.pad(x, (SEMANTIC_PAD, SEMANTIC_PAD))
        hidden = self.semantic_model(x, output_hidden_states=True).hidden_states
        features = torch.stack(hidden, dim=1).mean(dim=1)
        if cfg.semantic_downsample_factor > 1:
            features = features[:, :: cfg.semantic_downsample_factor, :]
        return features

    def acoustic_frames(self, num_samples: int) -> int:
        """Frames DAC's encoder makes of `num_samples` unpadded samples."""
        for conv in self._encoder_convs:
            num_samples = _conv_length(conv, num_samples)
        return num_samples

    @torch.inference_mode()
    def encode(self, wave: torch.Tensor) -> torch.Tensor:
        """[B, 1, N] float waveform at sample_rate -> [B, K, T] int64 codes (every quantizer)."""
        if wave.dim() != 3 or wave.shape[1] != 1:
            raise ValueError(f"encode: expected a mono waveform [batch, 1, samples], got {list(wave.shape)}")
        semantic = self.encoder_semantic(self._semantic_features(wave).transpose(1, 2))
        if self.acoustic_frames(wave.shape[2]) != semantic.shape[2]:
            wave = F.pad(wave, (self.pad, self.pad))
        acoustic = self.acoustic_encoder(wave)
        latent = self.fc(torch.cat([acoustic, semantic], dim=1).transpose(1, 2)).transpose(1, 2)
        return self.quantizer.encode(latent, self.config.target_bandwidths[-1]).transpose(0, 1)

    # -- decode ---------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, K, T] codes -> [B, 1, T * hop_length] waveform."""
        latent = self.quantizer.decode(codes.transpose(0, 1))
        return self.acoustic_decoder(self.fc2(latent.transpose(1, 2)).transpose(1, 2))

    def decode_window(self, codes: torch.Tensor, start: int, end: int, left_context: int,
                      right_context: int = 0) -> torch.Tensor:
        """The samples of frames [start, end) of `codes` [B, K, T], decoded from the frames
        [start - left_context, end + right_context) that exist: [B, 1, (end - start) * hop_length]. With
        both contexts at least the decoder's reach it equals the same span of the whole decode."""
        lo, hi = max(0, start - left_context), min(codes.shape[2], end + right_context)
        wave = self.decode(codes[:, :, lo:hi])
        return wave[..., (start - lo) * self.hop_length : (end - lo) * self.hop_length]
