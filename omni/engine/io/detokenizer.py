"""IncrementalDetokenizer: text deltas of a growing token sequence.

Decoding each new token alone is wrong twice over: a byte-level BPE token can
end in the middle of a multi-byte UTF-8 character (the decoder yields U+FFFD
until the rest arrives), and SentencePiece-style tokenizers decide leading
spaces from the token before. So, as vLLM does, every step decodes a short
window: the last few tokens already emitted (`prefix`) plus the new ones, and
emits the difference:

    ids:      ... a b c | d e | f       (| prefix_offset, | read_offset)
    prefix  = decode(ids[prefix_offset:read_offset])        "c d e" part already emitted
    window  = decode(ids[prefix_offset:])                   + "f"
    delta   = window[len(prefix):]   unless it ends in U+FFFD (incomplete character: wait)

Work per step is bounded by the window, not the sequence. `flush()` at the
end returns the rest exactly, so that the deltas concatenate to
`final_decode(all ids)`; the engine checks that and uses the concatenation as
the request's final text. The end of a reply can cut a character (max_tokens
after the first byte tokens of an emoji): its incomplete bytes are left out,
not shown as U+FFFD, as vLLM's detokenizer never emits them.
"""
from __future__ import annotations

from typing import Any

from omni.engine.io.token_bytes import TokenBytes

_WINDOW = 6  # tokens of left context kept for the next decode
_REPLACEMENT = "\ufffd"


def final_decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of a whole reply: decode(ids), less the U+FFFD of a character its last tokens began and did not
    end (their raw bytes end in an incomplete UTF-8 sequence, which the decoder shows as one U+FFFD). A U+FFFD a
    token spells as a character of its own stays, as with vLLM's fast detokenizer."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if text.endswith(_REPLACEMENT) and ids and _ends_incomplete(TokenBytes(tokenizer), ids):
        return text[:-1]
    return text


def _ends_incomplete(token_bytes: TokenBytes, ids: list[int]) -> bool:
    """Whether the last tokens' raw bytes end inside a UTF-8 character (a lead byte without all its bytes)."""
    raw = b"".join(token_bytes(t) for t in ids[-4:])[-4:]  # a character is at most 4 bytes
    for back in range(1, len(raw) + 1):
        byte = raw[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: its lead is further back
            continue
        need = 2 if 0xC0 <= byte < 0xE0 else 3 if 0xE0 <= byte < 0xF0 else 4 if 0xF0 <= byte < 0xF8 else 1
        return need > back
    return False


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text that became final (may be "")."""
        self.ids.extend(token_ids)
        if not token_ids:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if window.endswith(_REPLACEMENT) or len(window) <= len(prefix) or not window.startswith(prefix):
            # An incomplete character, nothing visible yet, or a merge that rewrote
            # the prefix: wait for more tokens (flush() settles the end exactly).
            return ""
        delta = window[len(prefix):]
        self.prefix_offset = max(self.read_offset, len(self.ids) - _WINDOW)
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The rest of the text at the end of the sequence (deltas + flush == decode(all ids))."""
        full = final_decode(self.tokenizer, self.ids, self.skip_special_tokens)
        if full.startswith(self.text):
            delta = full[len(self.text):]
        else:  # cannot happen for a prefix-stable decoder; keep what was sent, add nothing wrong
            delta = ""
        self.text += delta
        self.read_offset = self.prefix_offset = len(self.ids)
        return delta
