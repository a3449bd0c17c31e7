"""What the router matches on: a request's prefix as chained block hashes, computed in the driver.

    the caller's prompt                     keys of the entry stage            keys of a downstream stage
    -------------------                     -----------------------            ---------------------------
    prompt_token_ids                        exact: the stage's own block       lineage: the same hashes over the
    text / chat messages, tokenizer here    hashes (BlockHasher, its block     entry stage's sequence (prompt,
      (the entry stage's, same code)        size, seed, cache salt)            + output once it finished)
    otherwise (media, no tokenizer here)    text: chained hashes of the prompt's text, 64 characters a block

*Exact* keys are the blocks the stage will cache: a replica's eviction reports name them,
and a finished request's real hit can be compared block for block. A downstream stage
builds its input in the stage (a talker fed the thinker's hidden states): the driver
cannot hash it, but its rows follow the entry stage's sequence position by position, so
the entry sequence's hashes (in the downstream stage's block size) stand for its blocks:
the next turn of a conversation extends that sequence and lands where the previous turn's
rows are cached. The hidden states themselves still go actor to actor: only the routing
decision is made here.

Why the driver tokenizes: a conversation's next turn is text; without its token ids the
router could only match text, which no replica reports on. The entry stage's tokenizer is
loaded here once (when the model files are on this machine) and tokenizes with the very
function the stage uses (omni.prompts.tokenize_prompt). A stage model with its own
preprocessing (multimodal placeholders) tokenizes differently: the first finished request
whose token ids differ from the driver's turns driver tokenization off for the stage (with
a warning), and text keys take over.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from omni import registry
from omni.config.schema import StageConfig
from omni.engine.core.kv_cache.hashing import BlockHasher
from omni.messages import StageInput
from omni.prompts import tokenize_prompt

logger = logging.getLogger(__name__)

TEXT_BLOCK_CHARS = 64
_TEXT_SEED = 0x6F6D6E692E74787  # text keys live in their own hash domain


@dataclass(slots=True)
class RouteKeys:
    hashes: list[bytes]  # hashes[i] stands for blocks 0..i (chained)
    max_hit: int  # blocks a replica can hit at most (a prompt's last token is never a hit)
    aligned: bool  # hashes[i] is (or stands for) the stage's block i: hit feedback applies


@dataclass(slots=True)
class _Seq:
    """The fields BlockHasher reads from a Request: the stage's own hashing code runs unchanged here."""

    all_token_ids: list[int]
    cache_salt: str | None
    block_hashes: list[bytes] = field(default_factory=list)
    mm_features: tuple = ()
    adapter_id: None = None
    prompt_embeds_digests: None = None


def token_hashes(token_ids: list[int], block_size: int, seed: int, cache_salt: str | None = None) -> list[bytes]:
    """The block hashes a stage with this block size, seed and salt computes for these tokens (full blocks)."""
    return BlockHasher(block_size, seed)(_Seq(list(token_ids), cache_salt))


def prompt_text(request: StageInput) -> str | None:
    """The prompt as one string whose prefixes are the prefixes of the conversation (messages in order), after the
    request's voice: a text-to-speech model's prompt starts with the voice's reference (its transcript and clip),
    so requests in one voice share that prefix whatever they say (a talker's prompt holds its speaker too)."""
    extra = request.extra or {}
    voice = extra.get("speaker") or extra.get("reference_text")
    head = f"\x02voice\x00{voice}\x00" if voice else ""
    head = head.ljust(-(-len(head) // TEXT_BLOCK_CHARS) * TEXT_BLOCK_CHARS, "\x00")  # whole blocks: shared
    p = request.prompt
    if isinstance(p, str):
        return head + p
    if isinstance(p, list):
        return head + "".join(json.dumps([m.get("role"), m.get("content")], sort_keys=True, default=str) for m in p)
    return None


def text_hashes(text: str, cache_salt: str | None = None) -> list[bytes]:
    data = ((cache_salt or "") + "\x00" + text).encode("utf-8", "surrogatepass")
    out, parent = [], b"\x00" * 16
    step = TEXT_BLOCK_CHARS
    for off in range(0, len(data) - len(data) % step, step):
        parent = xxhash.xxh3_128_digest(parent + data[off:off + step], _TEXT_SEED)
        out.append(parent)
    return out


class DriverTokenizer:
    """The entry stage's tokenizer, in the driver (see the module docstring); None where it cannot be."""

    def __init__(self, stage: StageConfig):
        self.stage = stage
        self.state = "unloaded"  # -> ok | unavailable | mismatch
        self._tok: Any = None

    def load(self) -> None:
        if self.state != "unloaded":
            return
        self.state = "unavailable"
        try:
            path = Path(registry.resolve_model_path(self.stage.tokenizer or self.stage.model_path, "tokenizer path"))
            if not path.exists():  # never download from the driver: the stage's node may have the files
                return
            from transformers import AutoTokenizer

            if path.is_file() and path.suffix == ".gguf":
                self._tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            else:
                self._tok = AutoTokenizer.from_pretrained(str(path))
            self.state = "ok"
        except Exception as e:  # noqa: BLE001 - routing falls back to text keys
            logger.info("stage %s: no tokenizer in the driver (%s: %s); routing text prompts by their text",
                        self.stage.name, type(e).__name__, e)

    def tokenize(self, request: StageInput) -> list[int] | None:
        if request.mm_inputs or request.prompt is None or request.prompt_embeds is not None:
            return None
        self.load()
        if self.state != "ok":
            return None
        try:
            return tokenize_prompt(self._tok, request.prompt,
                                   self.stage.use_chat_template and request.chat_template is not False,
                                   self.stage.name, request.tools, request.chat_template_kwargs)
        except Exception:  # noqa: BLE001 - a bad prompt is the stage's to report
            return None

    def check(self, driver_ids: list[int], stage_ids: list[int]) -> None:
        """The stage's own token ids for a prompt this tokenized: a difference turns driver tokenization off."""
        if self.state == "ok" and list(driver_ids) != list(stage_ids):
            self.state = "mismatch"
            logger.warning("stage %s tokenizes prompts differently from its tokenizer in the driver (a stage "
                           "model with its own preprocessing?); routing text prompts by their text from now on",
                           self.stage.name)
