"""A token's own bytes, for logprobs' `bytes` field.

OpenAI (and vLLM) report each token's raw bytes, so that a client can rebuild text whose characters span
tokens: a byte-level BPE token may hold the first bytes of a multi-byte UTF-8 character, and decoding it
alone gives U+FFFD, whose bytes say nothing of the token. The raw bytes come from the token's vocabulary
string, read the way the tokenizer's decoder reads it:

    byte-level BPE (GPT-2, Qwen, SmolLM):  every character stands for one byte (GPT-2's bytes_to_unicode table)
    SentencePiece (Llama, Gemma):          `<0xE4>` byte-fallback tokens are that byte; `▁` is a space
    anything else, and added tokens:       the token decoded alone, as UTF-8

    token_bytes = TokenBytes(tokenizer)
    token_bytes(token_id) -> bytes
"""
from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level vocabulary writes -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decoder_kind(tokenizer: Any) -> str | None:
    """"byte_level", "sentencepiece" or None (unknown: tokens are decoded alone)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer: its decoder's own JSON says
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        state = decoder.__getstate__()
        state = state.decode() if isinstance(state, bytes) else str(state)
        if '"ByteLevel"' in state:
            return "byte_level"
        if '"ByteFallback"' in state or '"Metaspace"' in state or _SPIECE_SPACE in state:
            return "sentencepiece"
        return None
    if getattr(tokenizer, "byte_decoder", None) is not None:  # a slow GPT-2-style tokenizer
        return "byte_level"
    if getattr(tokenizer, "sp_model", None) is not None:  # a slow SentencePiece tokenizer
        return "sentencepiece"
    return None


class TokenBytes:
    """token id -> the token's raw bytes (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        # Added tokens (specials, chat markers) are stored as their text, not in the vocabulary's byte alphabet
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def __call__(self, token_id: int) -> bytes:
        token = None if self.kind is None or token_id in self.added else \
            self.tokenizer.convert_ids_to_tokens(int(token_id))
        if token is not None and self.kind == "byte_level":
            table = _byte_decoder()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
        elif token is not None and self.kind == "sentencepiece":
            fallback = _BYTE_FALLBACK.match(token)
            if fallback:
                return bytes([int(fallback[1], 16)])
            return token.replace(_SPIECE_SPACE, " ").encode("utf-8")
        return self.tokenizer.decode([int(token_id)]).encode("utf-8")
