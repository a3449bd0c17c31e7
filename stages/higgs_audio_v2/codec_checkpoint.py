"""Random Higgs Audio v2 codec checkpoints, as transformers' `HiggsAudioV2TokenizerModel.save_pretrained`
writes the real one (config.json + model.safetensors under transformers' key names), written once.

    tiny    (`higgs_codec_checkpoint("tiny")`): 4 quantizers of 64 entries, 480 samples a frame (50 Hz),
            a 4-level DAC of 32 channels, a 2-layer HuBERT of width 16
    tiny8   (`higgs_codec_checkpoint("tiny8")`): 8 quantizers of 128 entries, 960 samples a frame (25 Hz,
            other strides, odd ones among them), HuBERT's frames taken every second one as the real model's
    small   (`higgs_codec_checkpoint("small")`): the real model's decoder (DAC of width 1024, upsampling
            [8, 5, 4, 2, 3]: 960 samples a frame, 25 Hz; hidden size 256) and quantizer (8 x 1024 entries of
            64 dimensions), so that decoding costs what it costs for the real model; a 2-layer HuBERT of
            width 128 (encode runs once per voice)

The HuBERTs keep the real convolution stack (receptive field 400, hop 320 at 16 kHz): with transformers'
160 samples of padding each side, that is what makes their frames line up with DAC's.

The weights are drawn from numpy's PCG64 in float32, key by key in sorted order, so the same recipe writes the
same tensors whatever torch and transformers build the module (tests/data/make_higgs_codec_reference.py runs it
in transformers' own environment and records `state_digest` beside its outputs).

    python -m stages.higgs_audio_v2.codec_checkpoint [tiny|tiny8|small]   # build (or find) it, print its path
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
from pathlib import Path

from stages.checkpoints.cache import build_once, cache_root

_RECIPE_VERSION = 2  # v2: the decoder's last convolution scaled down (a waveform of a few tenths)
_SEED = 2026
SIZES = ("tiny", "tiny8", "small")
OUTPUT_CONV_STD = 1e-3

# HuBERT's real feature-encoder convolutions (receptive field 400, hop 320)
_HUBERT_CONV = dict(conv_kernel=[10, 3, 3, 3, 3, 2, 2], conv_stride=[5, 2, 2, 2, 2, 2, 2])


def codec_config(size: str):
    """The HiggsAudioV2TokenizerConfig of a SIZES name."""
    from stages.higgs_audio_v2.codec_model import codec_config_class

    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    if size == "tiny":
        acoustic = dict(encoder_hidden_size=4, downsampling_ratios=[4, 4, 6, 5], decoder_hidden_size=32,
                        upsampling_ratios=[5, 6, 4, 4], hidden_size=16)
        semantic = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        conv_dim=[8] * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
        # 50 frames/s x 6 bits = 300 bps a quantizer: 1.3 kbps -> 4 quantizers
        top = dict(codebook_size=64, codebook_dim=8, target_bandwidths=[0.6, 1.3])
    elif size == "tiny8":
        acoustic = dict(encoder_hidden_size=4, downsampling_ratios=[4, 4, 5, 4, 3], decoder_hidden_size=64,
                        upsampling_ratios=[4, 5, 4, 4, 3], hidden_size=16)
        semantic = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                        conv_dim=[8] * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
        # 25 frames/s x 7 bits = 175 bps a quantizer: 1.5 kbps -> 8 quantizers
        top = dict(codebook_size=128, codebook_dim=8, target_bandwidths=[0.5, 1.5], channel_ratios=[2, 1],
                   strides=[1, 1], block_dilations=[1, 3])
    else:
        acoustic = dict(encoder_hidden_size=32, downsampling_ratios=[8, 5, 4, 2, 3], decoder_hidden_size=1024,
                        upsampling_ratios=[8, 5, 4, 2, 3], hidden_size=256)
        semantic = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                        conv_dim=[64] * 7)
        # the real model's: 25 frames/s x 10 bits = 250 bps a quantizer: 2 kbps -> 8 quantizers
        top = dict(codebook_size=1024, codebook_dim=64, target_bandwidths=[0.5, 1, 1.5, 2])
    semantic = dict(**_HUBERT_CONV, mask_time_prob=0.0, **semantic)
    return codec_config_class()(acoustic_model_config=acoustic, semantic_model_config=semantic, **top)


def _std(key: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a tensor's random values: weights at 1 / sqrt(fan in), norms and Snake's alpha around 1
    (alpha divides), biases small, codebooks at the scale of what they quantize; the decoder's last
    convolution small enough for a waveform of a few tenths (Snake activations grow the signal, no tanh)."""
    if key == "acoustic_decoder.conv2.weight":
        return 0.0, OUTPUT_CONV_STD / math.sqrt(shape[1] * math.prod(shape[2:]))
    if key.endswith(".alpha") or "norm.weight" in key or key.endswith("original0") or key.endswith(".inited"):
        return 1.0, 0.0 if key.endswith(".inited") else 0.1
    if len(shape) >= 2 and "codebook" not in key:
        return 0.0, 1.0 / math.sqrt(shape[1] * math.prod(shape[2:]))
    if "codebook" in key:
        return 0.0, 1.0
    return 0.0, 0.02


def randomize(model, seed: int = _SEED) -> None:
    """Every tensor of the module's state (parameters and buffers) drawn from numpy's PCG64 in sorted key order."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    state = model.state_dict()
    with torch.no_grad():
        for key in sorted(state):
            mean, std = _std(key, tuple(state[key].shape))
            values = mean + std * rng.standard_normal(tuple(state[key].shape))
            state[key].copy_(torch.from_numpy(values.astype(np.float32)))


def state_digest(state: dict) -> str:
    """sha256 over the tensors (name, dtype, shape, bytes) in sorted key order: equal checkpoints, equal digests,
    whichever library wrote the file."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].contiguous()
        h.update(f"{key}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def write_higgs_codec(size: str, directory: str | os.PathLike) -> dict:
    """Write the SIZES codec into `directory` (config.json, model.safetensors); returns what it wrote."""
    import torch
    from safetensors.torch import save_file

    from stages.higgs_audio_v2.codec_model import HiggsCodec

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = codec_config(size)
    with torch.random.fork_rng(devices=[]):  # building the module draws its own init: not the caller's RNG
        model = HiggsCodec(config)
    randomize(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(directory))
    return {"arch": "higgs_audio_v2_tokenizer", "size": size, "seed": _SEED, "state_digest": state_digest(state),
            "parameters": sum(v.numel() for v in state.values()), "num_quantizers": config.num_quantizers}


def higgs_codec_checkpoint(size: str = "tiny", cache_dir: str | os.PathLike | None = None) -> Path:
    """A random Higgs Audio v2 codec directory (a SIZES name), built on first use."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    final = cache_root(cache_dir) / f"higgs-audio-v2-codec-{size}-v{_RECIPE_VERSION}"
    return build_once(final, lambda tmp: write_higgs_codec(size, tmp))


if __name__ == "__main__":
    print(higgs_codec_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
