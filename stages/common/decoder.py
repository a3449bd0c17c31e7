"""The KV geometry of a transformers decoder config, for every stage whose model is one (LMs, thinkers, talkers)."""
from __future__ import annotations

from typing import Any

from omni.engine.stage_model import KVSpec


def decoder_kv_spec(cfg: Any) -> KVSpec:
    """Layers, KV heads (num_attention_heads when the config has no GQA field) and head_dim (hidden_size / heads
    when the config names none)."""
    num_heads = cfg.num_attention_heads
    return KVSpec(num_layers=cfg.num_hidden_layers,
                  num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
                  head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
