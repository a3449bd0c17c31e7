"""Generic input processors (edges of a stage graph).

    fn(upstream: dict[str, StageOutput], request: StageInput) -> StageInput
    fn_chunk(chunk: StageDelta, request: StageInput, state) -> StageInput   (streaming edges; state: registry chunk_state)
"""
from __future__ import annotations

from typing import TypeVar

import numpy as np

from omni.errors import OmniError, RequestError
from omni.messages import EdgePayload, StageDelta, StageInput, StageOutput

P = TypeVar("P", bound=EdgePayload)


def single_upstream(upstream: dict[str, StageOutput], edge: str) -> StageOutput:
    """The one upstream output an edge `edge` takes: a ValueError (the request fails, naming the edge) when
    there is not exactly one, or when that stage failed."""
    if len(upstream) != 1:
        raise ValueError(f"{edge}: expects exactly one upstream stage, got {sorted(upstream)}")
    out = next(iter(upstream.values()))
    if out.error is not None:
        raise ValueError(f"{edge}: upstream stage {out.stage} failed: {out.error}")
    return out


def hidden_to_embeds(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """The upstream stage's last hidden states become the downstream prompt embeddings.

    One row per token the upstream stage computed (its prompt and generated
    tokens): the downstream model is conditioned on the whole sequence, as a
    talker is on its thinker. The token ids are placeholders; the embeddings'
    per-block digests in the block hashes keep different inputs apart in the
    prefix cache, while equal leading rows (a follow-up turn) still hit.
    """
    if len(upstream) != 1:
        raise OmniError(f"hidden_to_embeds takes exactly one upstream stage, got {sorted(upstream)}")
    (name, out), = upstream.items()
    if out.hidden_states is None:
        raise OmniError(f"hidden_to_embeds: stage {name!r} returned no hidden states")
    rows = np.ascontiguousarray(out.hidden_states, dtype=np.float32)
    return StageInput(request.request_id, prompt_token_ids=[0] * rows.shape[0], prompt_embeds=rows,
                      cache_salt=request.cache_salt)


def hidden_to_embeds_chunk(chunk: StageDelta, request: StageInput, state: object) -> StageInput:
    """hidden_to_embeds on a streaming edge: the rows computed since the last chunk become the
    next prompt rows. Over all chunks the prompt is exactly hidden_to_embeds' (one row per token
    the upstream computed, in order)."""
    rows = chunk.rows.get("hidden_states")
    if rows is None:
        if chunk.rows:
            raise OmniError(f"hidden_to_embeds: stage {chunk.stage!r} streamed no hidden states")
        return StageInput(request.request_id, prompt_token_ids=[], cache_salt=request.cache_salt)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    return StageInput(request.request_id, prompt_token_ids=[0] * rows.shape[0],
                      prompt_embeds=rows if rows.shape[0] else None, cache_salt=request.cache_salt)


def expect_payload(inp: StageInput, cls: type[P], processor: str) -> P:
    """`inp.payload` when it is what `processor` (the input processor that feeds this model) makes; a RequestError
    naming `payload` otherwise (a request sent to the stage directly, or through another processor)."""
    if not isinstance(inp.payload, cls):
        got = "none" if inp.payload is None else type(inp.payload).__name__
        raise RequestError(f"payload: expected a {cls.__name__} (the {processor} input processor makes it), "
                           f"got {got}", field="payload")
    return inp.payload
