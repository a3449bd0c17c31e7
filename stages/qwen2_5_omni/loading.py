"""Loading one part (thinker / talker / token2wav) of a full Qwen2.5-Omni checkpoint directory."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stages.common.parts import load_part


def load_omni_part(model_path: Path, part: str, cls: type, dtype: torch.dtype, device: torch.device,
                   attn: str = "sdpa", **kwargs: Any):
    """Load one part ("thinker" / "talker" / "token2wav") of a full Qwen2.5-Omni checkpoint: (part, full config)."""
    from transformers import Qwen2_5OmniConfig

    return load_part(Qwen2_5OmniConfig, model_path, part, cls, dtype, device, attn, **kwargs)
