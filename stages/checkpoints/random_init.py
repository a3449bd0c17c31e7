"""The random weights of the builtin omni checkpoints: decoders at a std large enough that logits spread and
greedy decoding wanders, encoders smaller, norms around 1, biases small (Qwen2.5-Omni and Qwen3-Omni alike)."""
from __future__ import annotations

TEXT_STD = 0.2  # as stages.checkpoints.tiny_lm's INIT_STD
ENCODER_STD = 0.1


def randomize_omni(model, gen, keep_prefix: str) -> None:
    """Every parameter of `model` drawn from `gen`, except those under `keep_prefix` (the audio part, whose
    initialisation the family does its own way)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(keep_prefix):
                continue
            std = ENCODER_STD if (".visual." in name or ".audio_tower." in name) else TEXT_STD
            if name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif "norm" in name or ".ln_" in name or "layer_norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
