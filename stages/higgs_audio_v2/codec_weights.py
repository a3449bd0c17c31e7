"""Reading a Higgs Audio v2 codec checkpoint's tensors into our module, key for key.

A directory written by transformers' `HiggsAudioV2TokenizerModel.save_pretrained` holds exactly our
module's keys. Two spellings of weight-normalised convolutions also occur in the wild: the original
codebase's `weight_g` / `weight_v` and torch's parametrization `parametrizations.weight.original0` /
`original1` (what DAC's `apply_weight_norm` leaves). Where our module holds a plain `weight` the pair is
folded into it (g * v / |v|, the norm taken over every dimension but g's), where it holds the
parametrization (HuBERT's positional convolution) the legacy pair is renamed to it. Anything else that does
not match fails the load, naming the keys.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# Saved by checkpoints of a HuBERT built with masking, unused by inference (transformers ignores it too).
IGNORED_KEYS = ("semantic_model.masked_spec_embed",)
_PAIRS = ((".weight_g", ".weight_v"), (".parametrizations.weight.original0", ".parametrizations.weight.original1"))


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `model.safetensors`, or of the shards its index names."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(directory / name)))
    return state


def _norm_dim(g: torch.Tensor) -> int:
    """The dimension weight_norm kept (g's one dimension longer than 1; -1: a single norm over everything)."""
    dims = [d for d, n in enumerate(g.shape) if n != 1]
    return dims[0] if len(dims) == 1 else -1


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The weight a weight-normalised layer computes from its magnitude g and direction v."""
    dim = _norm_dim(g)
    if dim == -1:
        return v * (g / v.norm())
    other = [d for d in range(v.dim()) if d != dim]
    return v * (g / v.norm(dim=other, keepdim=True))


def match_keys(state: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our module's key names (see the module docstring)."""
    out = {k: v for k, v in state.items() if k not in IGNORED_KEYS}
    for g_suffix, v_suffix in _PAIRS:
        for key in [k for k in out if k.endswith(g_suffix)]:
            base = key[: -len(g_suffix)]
            if base + ".weight" in wanted and base + v_suffix in out:
                g, v = out.pop(key), out.pop(base + v_suffix)
                out[base + ".weight"] = fold_weight_norm(g, v)
            elif g_suffix == ".weight_g" and base + ".parametrizations.weight.original0" in wanted:
                out[base + ".parametrizations.weight.original0"] = out.pop(key)
                out[base + ".parametrizations.weight.original1"] = out.pop(base + v_suffix)
    missing, unexpected = sorted(wanted - out.keys()), sorted(out.keys() - wanted)
    if missing or unexpected:
        raise ValueError(f"Higgs Audio v2 codec checkpoint does not match the model: missing {missing[:8]} "
                         f"({len(missing)}), unexpected {unexpected[:8]} ({len(unexpected)})")
    return out


def codec_directory(model_path: str | os.PathLike) -> Path | None:
    """Where a Higgs Audio v2 directory keeps its codec: the folder itself (a codec's own config.json), its
    `audio_tokenizer/` folder, or the local folder its processor_config.json names (`audio_tokenizer_name_or_path`,
    as `HiggsAudioV2Processor.save_pretrained` records the audio tokenizer it was given); None when none holds one."""
    import json

    path = Path(model_path).expanduser()
    config = path / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "higgs_audio_v2_tokenizer":
        return path
    if (path / "audio_tokenizer" / "config.json").is_file():
        return path / "audio_tokenizer"
    processor = path / "processor_config.json"
    if processor.is_file():
        named = (json.loads(processor.read_text()).get("audio_tokenizer") or {}).get("audio_tokenizer_name_or_path")
        if named:
            candidate = Path(named).expanduser()
            candidate = candidate if candidate.is_absolute() else path / candidate
            if (candidate / "config.json").is_file():
                return candidate
    return None
