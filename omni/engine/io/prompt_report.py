"""What a stage reports of a request's prompt when the request asks (completions' `echo`, `prompt_logprobs`):
the prompt decoded as the model saw it, each prompt token decoded alone, and each token's log-probability.

The finished StageOutput carries it; with echo a streamed request's first delta that carries generated
tokens does too (the whole prompt is computed by then, so its logprobs are complete), so that a streamed
completion can send the prompt first, as vLLM's does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni.messages import TokenLogprob

from omni.engine.io.token_bytes import TokenBytes


@dataclass(slots=True)
class PromptReport:
    text: str | None = None  # SamplingParams.echo_prompt
    token_texts: list[str] | None = None  # echo_prompt with prompt_logprobs: each prompt token decoded alone
    logprobs: list[TokenLogprob | None] | None = None  # prompt_logprobs (None for the first position)


def prompt_report(req: Any, tokenizer: Any) -> PromptReport:
    """The report a Request's sampling params ask for (empty when they ask for none)."""
    params, ids = req.sampling_params, req.prompt_token_ids
    out = PromptReport()
    if params.echo_prompt and tokenizer is not None:
        out.text = tokenizer.decode(list(ids))
    if params.prompt_logprobs is not None:
        text = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: None)
        raw = TokenBytes(tokenizer) if tokenizer is not None else (lambda t: None)
        texts = [text(t) for t in ids]  # each prompt token alone, decoded once for both lists below
        # req.prompt_logprobs[k] is prompt position k + 1's (the first position has none)
        out.logprobs = [None] + [
            TokenLogprob(t, lp, texts[k + 1], [(i, p, text(i), raw(i)) for i, p in top], rank, raw(t))
            for k, (t, lp, top, rank) in enumerate(req.prompt_logprobs)]
        if params.echo_prompt and tokenizer is not None:
            out.token_texts = texts
    return out
