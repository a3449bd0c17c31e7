"""Structured outputs: a request's reply constrained to a JSON schema, any JSON object, a regex or a choice.

`SamplingParams.structured_outputs` names one constraint (vLLM's StructuredOutputsParams keys):

    {"json": {...schema...}}   a JSON value valid against the schema (OpenAI's response_format json_schema)
    {"json_object": true}      any JSON object (OpenAI's response_format json_object)
    {"regex": "..."}           text matching the regex
    {"choice": ["a", "b"]}     exactly one of the strings

Each is compiled by llguidance (the grammar engine vLLM's `guidance` backend uses) against the stage's
tokenizer into a matcher: per request, per step, the set of tokens that keep the reply inside the
grammar (a bitmask over the vocabulary, which the sampler applies before anything else picks a token),
then the sampled token advances it. When the grammar is complete (the schema's value closed, the choice
spelled out) the request finishes with finish_reason "stop" (`Request.structured_done`); the model's
end-of-sequence token is allowed exactly where the grammar accepts. JSON is compact (no free whitespace
between tokens, as vLLM's `disable-any-whitespace`): a small model otherwise spends its tokens on blanks.

Only the scheduler's stop rule and the runner's sampling see it: matchers live in the runner's
per-request state, next to the request's random generator, and never leave the stage process.
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any

import torch

from omni.errors import RequestError

FIELD = "sampling_params.structured_outputs"


def _grammar(kind: str, value: Any) -> str:
    import llguidance

    compact = {"whitespace_flexible": False}
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=compact)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    return llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in value))


class GrammarCompiler:
    """One stage's compiler: the tokenizer's vocabulary is read once (on the first constrained request)."""

    def __init__(self, stage: str, tokenizer: Any, vocab_size: int, eos_token_id: int | None):
        self.stage = stage
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)  # the logits' width: ids past the tokenizer's are never allowed
        self.eos_token_id = eos_token_id
        self._lltok: Any = None

    def _error(self, text: str) -> RequestError:
        return RequestError(f"{FIELD}: {text}", stage=self.stage, field=FIELD)

    def matcher(self, spec: dict[str, Any]) -> Any:
        """A fresh llguidance matcher for one request; RequestError naming the field when the constraint does not
        compile (a bad schema or regex) or the stage cannot constrain (no tokenizer, llguidance missing)."""
        (kind, value), = spec.items()  # SamplingParams validated its shape (structured_spec.check_spec)
        if self.tokenizer is None:
            raise self._error(f"stage {self.stage!r} has no tokenizer to constrain its text with")
        try:
            import llguidance
        except ImportError:
            raise self._error("structured outputs need the llguidance package (pip install llguidance)") from None
        if self._lltok is None:
            try:
                self._lltok = _lltokenizer(self.tokenizer, self.vocab_size, self.eos_token_id)
            except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read (not a fast one, say)
                raise self._error(f"stage {self.stage!r}: its tokenizer cannot drive a grammar: {e}") from None
        try:
            grammar = _grammar(kind, value)
        except Exception as e:  # noqa: BLE001 - llguidance's own error for a grammar it cannot build
            raise self._error(f"{kind}: {e}") from None
        m = llguidance.LLMatcher(self._lltok, grammar)
        if m.is_error():
            raise self._error(f"{kind}: {m.get_error()}")
        return m


def _lltokenizer(tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> Any:
    """llguidance's view of a fast tokenizer (its `hf.from_tokenizer`, with one change). llguidance takes every added
    token for a special one (bytes it never matches against text), yet tokenizes text into them: a constraint that
    spells one out (Qwen's `<tool_call>`, not special: the model writes it as text) had only that token allowed, then
    refused it once sampled. Plain added tokens (not special, printable ASCII: the same text in a byte-level BPE's
    alphabet) go into the vocabulary as ordinary tokens instead, so the text can be written with them or byte by
    byte, and either is matched."""
    import llguidance

    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        plain = [a for a in spec.get("added_tokens", ())
                 if not a.get("special") and a["content"].isascii() and a["content"].isprintable()
                 and " " not in a["content"]]
        spec["added_tokens"] = [a for a in spec["added_tokens"] if a not in plain]
        for a in plain:
            model["vocab"].setdefault(a["content"], a["id"])
    return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size,
                                  eos_token=eos_token_id if eos_token_id is not None else tokenizer.eos_token_id)


def words(vocab_size: int) -> int:
    """int32 words of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def fill_bitmask(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """[rows, words] int32: bit t of row i set when token t may follow; a row without a matcher allows all."""
    import llguidance.torch as lt

    mask = torch.full((len(matchers), words(vocab_size)), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            lt.fill_next_token_bitmask(m, mask, i)
    return mask


def advance(matcher: Any, token: int) -> bool:
    """Feed the sampled token; True when the grammar is complete (nothing but the end may follow). A token the
    mask did not allow is a bug (the mask is applied before any other choice), named as one."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"structured outputs: token {token} was sampled outside the grammar: "
                           f"{matcher.get_error()}")
    return bool(matcher.is_stopped())
