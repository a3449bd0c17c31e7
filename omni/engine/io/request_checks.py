"""Request checking of one autoregressive stage (vLLM keeps this in its Processor): what the stage
knows and the edge does not, checked when a request arrives and when its input grows.

    token ids        prompt ids, stop ids: each in [0, vocabulary size)
    context length   prompt + max_tokens within max_model_len (never left waiting for room that
                     cannot come)
    prompt_embeds    [num_tokens, width] of finite numbers
    text prompts     tokenized here (entry stage only)
    empty prompts    refused before the stage model's own preprocessing sees them

Every refusal is a RequestError naming the stage, the field and the numbers; the stage keeps serving.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from omni.errors import ContextLengthError, RequestError
from omni.messages import StageInput
from omni.prompts import tokenize_prompt
from omni.sampling_params import SamplingParams


class RequestChecker:
    """The checks of one stage; `max_model_len` is read at each check (the engine resolves it once)."""

    def __init__(self, stage: str, vocab_size: int, tokenizer: Any, use_chat_template: bool, max_len_note: str = ""):
        self.stage = stage
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self.max_model_len = 0
        self.max_len_note = max_len_note  # why max_model_len is lower than configured, if it is

    def token_ids(self, ids: Iterable[int], field: str) -> list[int]:
        """Ids as ints, each in [0, vocabulary size)."""
        ids = [int(t) for t in ids]
        vocab = self.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise RequestError(
                    f"{field}: token id {t} is out of vocabulary (allowed 0..{vocab - 1}: stage {self.stage!r} "
                    f"has a vocabulary of {vocab})", stage=self.stage, field=field, limit=vocab, actual=t)
        return ids

    def sampling(self, params: SamplingParams) -> None:
        """Parameters that name tokens name tokens of this stage's vocabulary."""
        if params.stop_token_ids:
            self.token_ids(params.stop_token_ids, "sampling_params.stop_token_ids")
        if params.logit_bias:
            self.token_ids(params.logit_bias, "sampling_params.logit_bias")

    def fits(self, num_prompt: int, max_tokens: int, forced: str | None = None) -> None:
        """Admission: what cannot fit is refused now, never left waiting for room that cannot come. `forced`: the
        field of a reply forced to given tokens, `max_tokens` their count (what such a reply asks for is its
        tokens: the request's max_tokens plays no part, and the error must not cite it)."""
        limit, total = self.max_model_len, num_prompt + max_tokens
        if total > limit:
            reply, fix = ((f"max_tokens {max_tokens}", "lower max_tokens") if forced is None
                          else (f"a forced reply of {max_tokens} tokens", "the forced reply"))
            # The prompt alone fits: it is the reply that asks for too much.
            field = "prompt" if num_prompt >= limit else (forced or "sampling_params.max_tokens")
            raise ContextLengthError(
                f"prompt: {num_prompt} tokens + {reply} = {total} exceed max_model_len {limit} of "
                f"stage {self.stage!r}{self.max_len_note}; shorten the prompt or {fix}",
                stage=self.stage, field=field, limit=limit, actual=total)

    def prompt_embeds(self, value: Any, num_tokens: int, width: int) -> np.ndarray:
        """[num_tokens, width] float32 rows, all finite."""
        arr = np.ascontiguousarray(np.asarray(value, dtype=np.float32))
        if arr.ndim != 2 or arr.shape != (num_tokens, width):
            raise RequestError(f"prompt_embeds: expected shape ({num_tokens}, {width}), got {arr.shape}",
                               stage=self.stage, field="prompt_embeds")
        if not np.isfinite(arr).all():
            raise RequestError("prompt_embeds: contains NaN or infinite values", stage=self.stage,
                               field="prompt_embeds")
        return arr

    def prompt_ids(self, inp: StageInput) -> list[int]:
        """The prompt's token ids: given, tokenized here, or placeholders for an embeddings-only prompt."""
        if inp.prompt_token_ids is not None:
            return self.token_ids(inp.prompt_token_ids, "prompt_token_ids")
        if inp.prompt is None:
            if inp.prompt_embeds is not None:
                # Embeddings-only prompt: placeholder ids; the embeddings digest
                # in the block hashes keeps such prompts apart in the cache.
                return [0] * int(np.asarray(inp.prompt_embeds).shape[0])
            raise RequestError("prompt: a request needs `prompt`, `prompt_token_ids` or `prompt_embeds`",
                               stage=self.stage, field="prompt", code="missing_required_parameter")
        if self.tokenizer is None:
            raise RequestError(f"prompt: stage {self.stage} has no tokenizer; send prompt_token_ids instead",
                               stage=self.stage, field="prompt")
        return tokenize_prompt(self.tokenizer, inp.prompt, self.use_chat_template and inp.chat_template is not False,
                               self.stage, inp.tools, inp.chat_template_kwargs)

    def given_not_empty(self, inp: StageInput) -> None:
        """A prompt sent as no token ids (or no embedding rows) is empty whatever the stage model would make of
        it. Checked before the model's own preprocessing sees it: a model's prompt builder need not handle a
        prompt of 0 tokens (the Qwen2.5-Omni thinker's rotary index fails on one with an IndexError, which
        would read as the stage's failure, not the caller's)."""
        if inp.prompt_token_ids is not None:
            if len(inp.prompt_token_ids) == 0:
                self.not_empty([], "prompt_token_ids")
        elif inp.prompt is None and inp.prompt_embeds is not None and np.shape(inp.prompt_embeds)[:1] == (0,):
            raise RequestError("prompt_embeds: the prompt is empty (0 rows)", stage=self.stage, field="prompt_embeds")

    def not_empty(self, ids: list[int], field: str = "prompt") -> None:
        if not ids:
            raise RequestError(f"{field}: the prompt is empty (0 tokens)", stage=self.stage, field=field)
