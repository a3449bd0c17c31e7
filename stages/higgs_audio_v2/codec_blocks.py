"""The parts of Higgs Audio v2's codec that transformers defines beside its torchaudio import: the semantic
encoder / decoder convolutions and the residual vector quantizer.

transformers' `modeling_higgs_audio_v2_tokenizer` imports torchaudio at module level, which does not load
beside the project's torch, so these are written again here with the same attribute names (a checkpoint
saved by `HiggsAudioV2TokenizerModel.save_pretrained` loads into them key for key) and the same operations
(equal outputs). The acoustic DAC encoder / decoder and the HuBERT come from transformers' own modules.

The semantic decoder (and the wrapper's `fc1`) reconstruct HuBERT features only in training: encode and
decode never run them, but every checkpoint carries their weights, so they are built to load strictly.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResidualUnit(nn.Module):
    """ELU, dilated convolution, ELU, 1x1 convolution, plus the input."""

    def __init__(self, config, in_channels: int, out_channels: int, dilation: int):
        super().__init__()
        self.activation = nn.ELU()
        padding = ((config.unit_kernel_size - 1) // 2) * dilation
        self.conv1 = nn.Conv1d(in_channels, out_channels, config.unit_kernel_size, padding=padding,
                               dilation=dilation, bias=False)
        self.conv2 = nn.Conv1d(out_channels, out_channels, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.activation(self.conv1(self.activation(x))))


class SemanticEncoderBlock(nn.Module):
    def __init__(self, config, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.res_units = nn.ModuleList([ResidualUnit(config, in_channels, in_channels, d)
                                        for d in config.block_dilations])
        kernel = 3 if stride == 1 else 2 * stride  # stride 1 keeps a centred kernel of 3
        self.conv = nn.Conv1d(in_channels, out_channels, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    """HuBERT features [B, D, T] -> the semantic half of the codec's latent [B, D', T']."""

    def __init__(self, config):
        super().__init__()
        if len(config.strides) != len(config.channel_ratios):
            raise ValueError("Number of strides must match the number of channel_ratios.")
        size = config.semantic_hidden_size
        self.conv = nn.Conv1d(size, size, config.kernel_size, 1, config.kernel_size // 2, bias=False)
        blocks, in_channels = [], size
        for ratio, stride in zip(config.channel_ratios, config.strides):
            blocks.append(SemanticEncoderBlock(config, in_channels, int(size * ratio), stride))
            in_channels = int(size * ratio)
        self.conv_blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


class SemanticDecoderBlock(nn.Module):
    def __init__(self, config, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        if stride == 1:
            self.conv = nn.Conv1d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        else:
            self.conv = nn.ConvTranspose1d(in_channels, out_channels, 2 * stride, stride, (stride + 1) // 2,
                                           stride % 2, bias=False)
        self.res_units = nn.ModuleList([ResidualUnit(config, out_channels, out_channels, d)
                                        for d in config.block_dilations])


class SemanticDecoder(nn.Module):
    """Training's reconstruction of the HuBERT features (weights only: see the module docstring)."""

    def __init__(self, config):
        super().__init__()
        size, ratios = config.semantic_hidden_size, config.channel_ratios
        self.conv1 = nn.Conv1d(size, int(size * ratios[0]), config.kernel_size, 1, config.kernel_size // 2,
                               bias=False)
        outs = [int(size * r) for r in ratios[1:]] + [size]
        self.conv_blocks = nn.ModuleList([SemanticDecoderBlock(config, int(size * r), out, stride)
                                          for r, out, stride in zip(ratios, outs, config.strides)])
        self.conv2 = nn.Conv1d(size, size, config.kernel_size, 1, config.kernel_size // 2, bias=False)


class EuclideanCodebook(nn.Module):
    """A codebook searched by Euclidean distance (its buffers are the checkpoint's, `embed` the one used)."""

    def __init__(self, config):
        super().__init__()
        embed = torch.zeros(config.codebook_size, config.codebook_dim)
        self.inited = nn.Buffer(torch.Tensor([True]))
        self.cluster_size = nn.Buffer(torch.zeros(config.codebook_size))
        self.embed = nn.Buffer(embed)
        self.embed_avg = nn.Buffer(embed.clone())

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> [...] nearest entries (the distance written as transformers writes it: same ties)."""
        flat = x.reshape(-1, x.shape[-1])
        embed = self.embed.t()
        dist = -(flat.pow(2).sum(1, keepdim=True) - 2 * flat @ embed + embed.pow(2).sum(0, keepdim=True))
        return dist.max(dim=-1).indices.view(*x.shape[:-1])

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return F.embedding(codes, self.embed)


class VectorQuantization(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.codebook = EuclideanCodebook(config)
        self.project_in = nn.Linear(config.hidden_size, config.codebook_dim)
        self.project_out = nn.Linear(config.codebook_dim, config.hidden_size)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[B, hidden, T] -> [B, T] codes."""
        return self.codebook.encode(self.project_in(x.permute(0, 2, 1)))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, T] codes -> [B, hidden, T]."""
        return self.project_out(self.codebook.decode(codes)).permute(0, 2, 1)


class ResidualVectorQuantizer(nn.Module):
    """Residual vector quantization (SoundStream's algorithm 1): each quantizer codes what the ones before
    it left over; the codes of the first `n` quantizers are the stream at a lower bandwidth."""

    def __init__(self, config):
        super().__init__()
        self.quantizers = nn.ModuleList([VectorQuantization(config) for _ in range(config.num_quantizers)])
        self.frame_rate = config.frame_rate
        self.codebook_size = config.codebook_size

    def num_quantizers_for(self, bandwidth: float) -> int:
        """Quantizers that fit `bandwidth` kbps (at least one)."""
        per_quantizer = math.log2(self.codebook_size) * self.frame_rate / 1000
        return int(max(1, math.floor(bandwidth / per_quantizer)))

    def encode(self, x: torch.Tensor, bandwidth: float) -> torch.Tensor:
        """[B, hidden, T] -> [K, B, T] codes."""
        residual, codes = x, []
        for quantizer in self.quantizers[: self.num_quantizers_for(bandwidth)]:
            idx = quantizer.encode(residual)
            residual = residual - quantizer.decode(idx)
            codes.append(idx)
        return torch.stack(codes)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """[K, B, T] codes -> [B, hidden, T]: the quantizers' vectors summed in order."""
        out = torch.full((), 0.0, device=codes.device)
        for quantizer, idx in zip(self.quantizers, codes):
            out = out + quantizer.decode(idx)
        return out
