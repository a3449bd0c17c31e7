"""The tokenizer a stage's config names, loaded outside the stage: in the driver (the router's prefix keys,
omni/pipeline/routing/keys.py) and in the server (vLLM's /tokenize, omni/serve/tokenization.py).

    tok = load_stage_tokenizer(stage_config)    # raises TokenizerUnavailable saying why there is none

The config's `tokenizer`, else the model's own files (a GGUF file's embedded tokenizer too). Never downloaded:
the stage runs where its files are, which need not be this machine, and a missing tokenizer here only costs
the caller a fallback (text keys, a 400), not the request.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omni import registry
from omni.config import StageConfig


class TokenizerUnavailable(Exception):
    """No tokenizer of the stage can be loaded here; the message says why."""


def load_stage_tokenizer(stage: StageConfig) -> Any:
    path = Path(registry.resolve_model_path(stage.tokenizer or stage.model_path, "tokenizer path"))
    if not path.exists():
        raise TokenizerUnavailable(f"its tokenizer's files ({path}) are not on this machine")
    from transformers import AutoTokenizer

    try:
        if path.is_file() and path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - a model without a tokenizer (token ids only): the caller falls back
        raise TokenizerUnavailable(f"it has no tokenizer ({type(e).__name__}: {e})") from e
