"""Loading one part (thinker / talker / token2wav / code2wav) of a full omni checkpoint directory: the part's
config out of the full one, and only the weights under its prefix (Qwen2.5-Omni and Qwen3-Omni alike)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from stages.checkpoints.cache import MARKER  # written last into every builtin checkpoint


def load_part(config_cls: type, model_path: Path, part: str, cls: type, dtype: torch.dtype, device: torch.device,
              attn: str = "sdpa", **kwargs: Any):
    """`cls` built from the `{part}_config` of `config_cls.from_pretrained(model_path)` with the checkpoint's
    `{part}.*` weights: (the part, in eval mode on `device`; the full config)."""
    from transformers.utils import logging as hf_logging

    full = config_cls.from_pretrained(str(model_path))
    config = getattr(full, f"{part}_config")
    seed = random_weights_seed(model_path)
    if seed is not None:
        return _random_part(cls, config, dtype, device, attn, seed), full
    # The other parts' weights are "unexpected" for this one: keep transformers' load report quiet.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = cls.from_pretrained(str(model_path), config=config, dtype=dtype, attn_implementation=attn,
                                    key_mapping={rf"^{part}\.": ""}, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval(), full


def random_weights_seed(model_path: Path) -> int | None:
    """The seed of a checkpoint that ships no weights (`builtin:qwen2_5-omni-7b-shapes`), else None."""
    marker = Path(model_path) / MARKER
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text()).get("random_weights")
    return None if info is None else int(info["seed"])


def _random_part(cls: type, config: Any, dtype: torch.dtype, device: torch.device, attn: str, seed: int):
    """`cls` with transformers' own initialisation, made directly on `device` (a 7B part in seconds on a GPU, no copy
    through host memory), from `seed`."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls._from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def load_thinker_embedding(config_cls: type, model_path: Path, dtype: torch.dtype,
                           device: torch.device) -> torch.nn.Embedding:
    """The thinker's token embedding table alone, read from the checkpoint's safetensors (a talker embeds the
    thinker's tokens with it); `config_cls`: the family's full config class."""
    from safetensors import safe_open

    seed = random_weights_seed(model_path)
    if seed is not None:  # a checkpoint without weights: a table of the thinker's shape, made on the device
        text = config_cls.from_pretrained(str(model_path)).thinker_config.text_config
        gen = torch.Generator(device=device).manual_seed(seed)
        weight = torch.randn(text.vocab_size, text.hidden_size, generator=gen, device=device, dtype=dtype) * 0.02
        return torch.nn.Embedding.from_pretrained(weight, freeze=True)
    key = "thinker.model.embed_tokens.weight"
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            if key in fh.keys():
                weight = fh.get_tensor(key)
                return torch.nn.Embedding.from_pretrained(weight.to(device, dtype), freeze=True)
    raise ValueError(f"model_path: no {key} in {model_path}")
