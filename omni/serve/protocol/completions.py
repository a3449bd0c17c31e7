"""Completions' request (OpenAI's openai/types/completion_create_params.py, every field known; the fields it
shares with chat in protocol/generation.py): a prompt as text or token ids, or a batch of them.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from omni.config.pydantic_errors import accepts
from omni.serve.protocol.base import check_unsupported, field_error, whole_number
from omni.serve.protocol.generation import GenerationRequest

COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}


def _token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class CompletionRequest(GenerationRequest):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], accepts(
        "a string, a list of token ids, or a batch of prompts (a list of strings or a list of token-id lists)"
    )] = Field(
        description="The prompt: text or token ids; or a batch of prompts (a list of strings, or a list of token-id "
        "lists), every one run at once: one choice per prompt and n, index prompt_index * n + i (vLLM's order).")
    logprobs: int | None = Field(None, ge=0, le=5, description="Return each token's log-probability and those "
                                 "of the 0..5 most likely tokens at its position (the text stage).")
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate at most (the text stage); 0 only "
                                   "with echo: the prompt alone comes back (with its logprobs), nothing generated.")
    best_of: Any = Field(None, description="Not implemented: null or 1.")
    echo: bool | None = Field(None, description="The text starts with the prompt as the text stage saw it, "
                              "decoded (token ids, or a chat template the stage wraps a raw prompt in); with "
                              "logprobs, the prompt's tokens come first in `logprobs` (the first with a null "
                              "logprob; the prompt is then recomputed: no prefix-cache hit). Streamed, the prompt "
                              "comes first, in a chunk of its own.")
    suffix: Any = Field(None, description='Not implemented: null or "".')
    add_special_tokens: bool | None = Field(None, description="vLLM's: a text prompt is tokenized with the "
                                            "tokenizer's special tokens (true, the default); false is not "
                                            "implemented.")

    _whole_completion = field_validator("logprobs", mode="before")(classmethod(lambda cls, v: whole_number(v)))

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        check_unsupported(self, {**COMPLETION_UNSUPPORTED, "add_special_tokens": (None, True)})
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "must be >= 1 (0 only with echo: true, which returns the prompt alone)")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_items(cls, prompt: Any) -> Any:
        """A list prompt checked item by item, so that a bad prompt of a batch is refused naming it (`prompt[2]`,
        `prompt[2][5]` for a token id); what no shape takes at all is then refused by the field's type (`prompt`).
        (A field validator, not the model's: a model `before` validator would have the whole request validated
        from Python objects, where strict mode refuses JSON's string keys of logit_bias.)"""
        if not isinstance(prompt, list):
            return prompt
        if not prompt:
            raise field_error("", "must not be empty")
        first = prompt[0]
        if _token_id(first):  # one prompt, as token ids
            bad = next((j for j, t in enumerate(prompt) if not _token_id(t)), None)
            if bad is not None:
                raise field_error(f"[{bad}]", "expected a token id (an integer), as prompt[0] is")
            return prompt
        if not isinstance(first, (str, list)):
            raise field_error("[0]", "expected a string, a list of token ids or a token id")
        kind = "a string" if isinstance(first, str) else "a list of token ids"
        for i, item in enumerate(prompt):
            if not isinstance(item, type(first)):
                raise field_error(f"[{i}]", f"expected {kind}, as prompt[0] is (a batch is of one kind)")
            if not item:
                raise field_error(f"[{i}]", "must not be empty")
            bad = next((j for j, t in enumerate(item) if not _token_id(t)), None) if isinstance(item, list) else None
            if bad is not None:
                raise field_error(f"[{i}][{bad}]", "expected a token id (an integer)")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: str | list[int] | list[str] | list[list[int]]) -> Any:
        if not v:
            raise ValueError("must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts in order: one, or the batch's."""
        p = self.prompt
        if isinstance(p, str) or _token_id(p[0]):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (not asked), else how many most likely tokens per position."""
        return self.logprobs
