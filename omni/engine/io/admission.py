"""Admission of one autoregressive stage (vLLM's input processor): a StageInput in, a Request out.

    sampling         the request's parameters over the stage's defaults; the tokens they name
    prompt           given, tokenized here, or rendered by the stage model (its preprocess); cut to
                     truncate_prompt_tokens (a caller's prompt only)
    the reply        max_tokens fitted to what the prompt leaves, or a reply forced to given tokens /
                     text; prompt + reply within max_model_len
    extras           prompt logprobs, a grammar (structured outputs), prompt embeddings and their
                     per-block digests

Every refusal is a RequestError (request_checks.py) naming the stage, the field and the numbers, raised
before anything of the stage is touched: the engine then hands the Request to its scheduler, runner and
model. A growing prompt's chunks are checked by the same RequestChecker (`checks`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni.errors import ContextLengthError, RequestError
from omni.messages import StageInput
from omni.sampling_params import SamplingParams, resolve_sampling_params

from omni.engine.core.kv_cache.hashing import BlockHasher
from omni.engine.core.request import Request
from omni.engine.io.request_checks import RequestChecker
from omni.engine.io.request_streams import block_digests
from omni.engine.io.structured_output import GrammarCompiler
from omni.engine.stage_model import AutoregressiveStageModel, PreparedPrompt


@dataclass(slots=True)
class Admitted:
    """A request that passed admission, and what the engine hands its runner and model with it."""

    request: Request
    params: SamplingParams  # resolved: the stage's defaults under the request's, max_tokens fitted
    prepared: PreparedPrompt | None  # the stage model's own rendering of the prompt (None: plain ids)
    forced: list[int] | None  # the reply's tokens when it is forced
    grammar: Any  # the structured-output matcher, or None
    embeds: torch.Tensor | None  # the prompt's embedding rows on the model's device
    prompt_rows: np.ndarray | None  # the same rows on the host (a growing prompt's digests need them)


class Admission:
    """The admission of one stage; `checks.max_model_len` is resolved by the engine before the first request."""

    def __init__(self, name: str, model: AutoregressiveStageModel, checks: RequestChecker, block_size: int,
                 block_hasher: BlockHasher | None, default_sampling: SamplingParams, takes_caller_prompt: bool):
        self.name = name
        self.model = model
        self.tokenizer = model.tokenizer
        self.checks = checks
        self.grammars = GrammarCompiler(name, self.tokenizer, model.vocab_size, model.eos_token_id)
        self.block_size = block_size
        self.block_hasher = block_hasher
        self.default_sampling = default_sampling
        # The stage's prompts are the caller's: truncate_prompt_tokens cuts only those.
        self.takes_caller_prompt = takes_caller_prompt

    def admit(self, inp: StageInput) -> Admitted:
        params = resolve_sampling_params(inp.sampling_params, self.default_sampling, self.name)
        self.checks.sampling(params)
        self.checks.given_not_empty(inp)  # before any stage model's preprocess: none need handle 0 tokens
        prepared = self.model.preprocess(inp)
        if prepared is None and inp.mm_inputs:  # the stage model would silently drop them
            kinds = sorted({m.modality for m in inp.mm_inputs})
            raise RequestError(f"multi_modal_data: stage {self.name!r} takes no {'/'.join(kinds)} inputs "
                               "(a text-only model)", stage=self.name, field="multi_modal_data")
        if prepared is not None and inp.tools and not (self.model.info.renders_tools
                                                       or self.model.info.passes_tools_on):
            # its own prompt renderer, which shows the model no tools: they would be silently dropped
            raise RequestError(f"tools: stage {self.name!r} renders its own prompt and shows the model no tools",
                               stage=self.name, field="tools")
        token_ids = (self.checks.token_ids(prepared.token_ids, "prompt_token_ids") if prepared is not None
                     else self.checks.prompt_ids(inp))
        prompt_embeds = prepared.prompt_embeds if prepared is not None else inp.prompt_embeds
        self.checks.not_empty(token_ids)
        if params.truncate_prompt_tokens is not None and self.takes_caller_prompt:
            token_ids = self._truncated(token_ids, params.truncate_prompt_tokens,
                                        prepared is not None or prompt_embeds is not None or not inp.input_complete)
        params = self._fit_reply(params, len(token_ids))
        forced = self._forced_reply(params, inp, len(token_ids))
        if forced is None and prepared is not None and prepared.forced_reply is not None:
            forced = self.checks.token_ids(prepared.forced_reply, "forced_reply")
        if params.prompt_logprobs is not None and (forced is not None or not inp.input_complete):
            raise RequestError("sampling_params.prompt_logprobs: needs a complete prompt and a sampled reply (not a "
                               "streamed input, nor a forced reply)", stage=self.name,
                               field="sampling_params.prompt_logprobs")
        grammar = None if params.structured_outputs is None else self.grammars.matcher(params.structured_outputs)
        embeds, digests, rows = None, None, None
        if prompt_embeds is not None:
            embeds, digests, rows = self.prompt_embeds(prompt_embeds, len(token_ids))
        req = Request(
            inp.request_id, token_ids, sampling_params=params, cache_salt=inp.cache_salt,
            mm_features=prepared.mm_features if prepared is not None else (),
            prompt_embeds_digests=digests, block_hasher=self.block_hasher,
            arrival_time=time.monotonic(), eos_token_id=self.model.eos_token_id,
        )
        return Admitted(req, params, prepared, forced, grammar, embeds, rows)

    def admit_chunk(self, req: Request, has_embeds: bool, token_ids: list[int],
                    prompt_embeds: Any) -> tuple[list[int], torch.Tensor | None, np.ndarray | None]:
        """A growing prompt's next chunk, checked as its start was (ids in the vocabulary, the prompt still fits;
        a prompt that started as embeddings grows by embeddings): its ids, and its embedding rows on the device
        and on the host (None for ids)."""
        token_ids = self.checks.token_ids(token_ids, "prompt_token_ids")
        self.checks.fits(req.num_prompt_tokens + len(token_ids), req.sampling_params.max_tokens)
        if (prompt_embeds is not None) != has_embeds and token_ids:
            raise RequestError("prompt_embeds: a prompt that started as embeddings grows by embeddings, and a "
                               "prompt of token ids by token ids", stage=self.name, field="prompt_embeds")
        if prompt_embeds is None or not token_ids:
            return token_ids, None, None
        rows, _, arr = self.prompt_embeds(prompt_embeds, len(token_ids))
        return token_ids, rows, arr

    def prompt_embeds(self, value: Any, num_tokens: int) -> tuple[torch.Tensor, list[bytes], np.ndarray]:
        """Checked embedding rows: on the model's device, their per-block digests, and on the host."""
        model = self.model
        arr = self.checks.prompt_embeds(value, num_tokens, model.prompt_embed_size or model.hidden_size)
        # One digest per block of rows: the block hashes chain them, so equal
        # leading embeddings still share blocks across turns.
        digests = block_digests(arr, self.block_size)
        t = torch.from_numpy(arr).to(device=model.device, dtype=model.dtype)
        return t, digests, arr

    def _fit_reply(self, params: SamplingParams, n: int) -> SamplingParams:
        """max_tokens_fit: max_tokens lowered to what the prompt of `n` tokens leaves in max_model_len."""
        if not params.max_tokens_fit:
            return params
        max_len = self.checks.max_model_len
        room = max_len - n - params.reserve_tokens  # what the prompt leaves the reply
        if room < 1:
            raise ContextLengthError(
                f"prompt: {n} tokens leave no room for a reply in max_model_len {max_len} of stage "
                f"{self.name!r}{self.checks.max_len_note} (with {params.reserve_tokens} tokens kept free for the "
                "stages after it); shorten the prompt", stage=self.name, field="prompt",
                limit=max_len - params.reserve_tokens, actual=n)
        if params.max_tokens > room:
            params = params.model_copy(update={"max_tokens": room, "min_tokens": min(params.min_tokens, room)})
        return params

    def _truncated(self, token_ids: list[int], keep: int, fixed: bool) -> list[int]:
        """The last `keep` tokens of the prompt (-1: max_model_len), vLLM's truncate_prompt_tokens. `fixed`: the
        prompt is not plain tokens (the model rendered it with positions or features of its own, it came as
        embeddings, or it is still streaming in): it is refused if it would have to be cut."""
        field = "sampling_params.truncate_prompt_tokens"
        max_len = self.checks.max_model_len
        if keep == -1:
            keep = max_len
        if keep > max_len:
            raise RequestError(f"{field}: {keep} is greater than max_model_len {max_len} of stage "
                               f"{self.name!r}; choose a smaller truncation size", stage=self.name, field=field,
                               limit=max_len, actual=keep)
        if len(token_ids) <= keep:
            return token_ids
        if fixed:
            raise RequestError(f"{field}: the prompt of stage {self.name!r} has {len(token_ids)} tokens, more than "
                               f"{keep}, and cannot be cut (the stage renders its own prompt, or it came as "
                               "embeddings or as a streamed input); shorten the prompt", stage=self.name, field=field,
                               limit=keep, actual=len(token_ids))
        return token_ids[-keep:]

    def _forced_reply(self, params: SamplingParams, inp: StageInput, n: int) -> list[int] | None:
        """The token ids the reply is forced to (sampling_params.forced_token_ids / forced_text), None when it is
        sampled; either way prompt + reply are checked against max_model_len."""
        forced = self._forced_ids(params)
        if forced is None:
            self.checks.fits(n, params.max_tokens)
            return None
        if not inp.input_complete:
            raise RequestError("sampling_params.forced_token_ids: a forced reply follows a complete prompt; this "
                               "request's input still streams in", stage=self.name,
                               field="sampling_params.forced_token_ids")
        self.checks.fits(n, len(forced), "sampling_params.forced_token_ids" if params.forced_token_ids is not None
                         else "sampling_params.forced_text")
        return forced

    def _forced_ids(self, params: SamplingParams) -> list[int] | None:
        if params.forced_token_ids is not None:
            return self.checks.token_ids(params.forced_token_ids, "sampling_params.forced_token_ids")
        if params.forced_text is None:
            return None
        if self.tokenizer is None:
            raise RequestError(f"sampling_params.forced_text: stage {self.name!r} has no tokenizer; send "
                               "forced_token_ids instead", stage=self.name, field="sampling_params.forced_text")
        ids = list(self.tokenizer.encode(params.forced_text, add_special_tokens=False))
        if self.model.eos_token_id is not None:
            ids.append(int(self.model.eos_token_id))
        if not ids:
            raise RequestError("sampling_params.forced_text: the text has no tokens", stage=self.name,
                               field="sampling_params.forced_text")
        return self.checks.token_ids(ids, "sampling_params.forced_text")
