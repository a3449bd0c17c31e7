"""Loading one part (thinker / talker / code2wav) of a full Qwen3-Omni checkpoint directory."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stages.common.parts import load_part

TALKER_TEXT_MODEL_TYPE = "qwen3_omni_moe_talker_text"


def load_qwen3_omni_part(model_path: Path, part: str, cls: type, dtype: torch.dtype, device: torch.device,
                         attn: str = "sdpa", **kwargs: Any):
    """Load one part ("thinker" / "talker" / "code2wav") of a full Qwen3-Omni checkpoint: (part, full config)."""
    from transformers import Qwen3OmniMoeConfig

    return load_part(Qwen3OmniMoeConfig, model_path, part, cls, dtype, device, attn, **kwargs)


def register_talker_expert_conversion() -> None:
    """Checkpoints store the talker's experts one by one (experts.N.gate_proj / up_proj / down_proj), as the
    30B release does; transformers fuses them on load for the full model and the thinker (their model types
    map to qwen2_moe's conversion) but not for the talker's decoder loaded alone, whose fused expert tensors
    would stay uninitialized. Register the same conversion for its model type (once per process)."""
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    if get_checkpoint_conversion_mapping(TALKER_TEXT_MODEL_TYPE) is None:
        register_checkpoint_conversion_mapping(TALKER_TEXT_MODEL_TYPE, get_checkpoint_conversion_mapping("qwen2_moe"))
