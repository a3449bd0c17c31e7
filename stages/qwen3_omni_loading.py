"""Loading one part (thinker / talker / code2wav) of a full Qwen3-Omni checkpoint directory."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TALKER_TEXT_MODEL_TYPE = "qwen3_omni_moe_talker_text"


def load_qwen3_omni_part(model_path: Path, part: str, cls: type, dtype: torch.dtype, device: torch.device,
                         attn: str = "sdpa", **kwargs: Any):
    """Load one part ("thinker" / "talker" / "code2wav") of a full Qwen3-Omni checkpoint: (part, full config)."""
    from transformers import Qwen3OmniMoeConfig
    from transformers.utils import logging as hf_logging

    full = Qwen3OmniMoeConfig.from_pretrained(str(model_path))
    config = getattr(full, f"{part}_config")
    # The other parts' weights are "unexpected" for this one: keep transformers' load report quiet.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = cls.from_pretrained(str(model_path), config=config, dtype=dtype, attn_implementation=attn,
                                    key_mapping={rf"^{part}\.": ""}, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval(), full


def register_talker_expert_conversion() -> None:
    """Checkpoints store the talker's experts one by one (experts.N.gate_proj / up_proj / down_proj), as the
    30B release does; transformers fuses them on load for the full model and the thinker (their model types
    map to qwen2_moe's conversion) but not for the talker's decoder loaded alone, whose fused expert tensors
    would stay uninitialized. Register the same conversion for its model type (once per process)."""
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    if get_checkpoint_conversion_mapping(TALKER_TEXT_MODEL_TYPE) is None:
        register_checkpoint_conversion_mapping(TALKER_TEXT_MODEL_TYPE, get_checkpoint_conversion_mapping("qwen2_moe"))
