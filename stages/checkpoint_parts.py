"""Loading one part (thinker / talker / token2wav / code2wav) of a full omni checkpoint directory: the part's
config out of the full one, and only the weights under its prefix (Qwen2.5-Omni and Qwen3-Omni alike)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_part(config_cls: type, model_path: Path, part: str, cls: type, dtype: torch.dtype, device: torch.device,
              attn: str = "sdpa", **kwargs: Any):
    """`cls` built from the `{part}_config` of `config_cls.from_pretrained(model_path)` with the checkpoint's
    `{part}.*` weights: (the part, in eval mode on `device`; the full config)."""
    from transformers.utils import logging as hf_logging

    full = config_cls.from_pretrained(str(model_path))
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
