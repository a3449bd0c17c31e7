"""Qwen2.5-Omni: thinker -> talker -> token2wav stages and the input processors between them.

    thinker   (stages/qwen2_5_omni/thinker.py)   text/image/audio -> text tokens + hidden states
    talker    (stages/qwen2_5_omni/talker.py)    thinker states -> codec tokens
    token2wav (stages/qwen2_5_omni/token2wav.py) codec tokens -> 24 kHz waveform (no KV cache)

Input processors (`fn(upstream, request) -> StageInput`, registered as thinker2talker / talker2wav)
run in the downstream stage's worker (where that stage runs) on plain numpy data: they only route
what the upstream stage produced. Their chunk forms (`*_chunk`) do the same on a streaming edge,
one upstream chunk at a time (see the talker's and token2wav's docstrings for what they do with it).
They hand the models typed payloads (stages/qwen2_5_omni/payloads.py). The talker's sampling parameters
come from the caller's `request.extra["talker_sampling_params"]` (else the stage defaults); the speaker
from `request.extra["speaker"]` (default Chelsie).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni.messages import StageDelta, StageInput, StageOutput

from stages.common.processors import single_upstream
from stages.common.talker_feed import Fed, TalkerFeed, reply_rows
from stages.qwen2_5_omni.payloads import CodesToWave, ThinkerToTalker
from stages.qwen2_5_omni.talker import Qwen2_5OmniTalkerStage
from stages.qwen2_5_omni.thinker import Qwen2_5OmniThinkerStage
from stages.qwen2_5_omni.token2wav import Qwen2_5OmniToken2WavStage

__all__ = ["Qwen2_5OmniThinkerStage", "Qwen2_5OmniTalkerStage", "Qwen2_5OmniToken2WavStage",
           "thinker2talker", "talker2wav", "thinker2talker_chunk", "talker2wav_chunk", "CODEC_EOS_TOKENS",
           "CodesFeed"]

# transformers' generate stops the talker at either token and cuts the codes before the first one.
CODEC_EOS_TOKENS = (8292, 8294)


def thinker2talker(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Thinker output -> talker input: token ids, last hidden states and 3-D rotary positions."""
    out = single_upstream(upstream, "thinker2talker")
    if out.hidden_states is None or "mrope_positions" not in out.mm_outputs:
        raise ValueError("thinker2talker: the thinker output carries no hidden states / mrope_positions "
                         "(is the upstream a qwen2_5_omni_thinker stage?)")
    n = len(out.prompt_token_ids)
    payload = ThinkerToTalker(prompt_ids=list(out.prompt_token_ids), output_ids=list(out.token_ids),
                              hidden=np.asarray(out.hidden_states, dtype=np.float32),
                              positions=np.asarray(out.mm_outputs["mrope_positions"][:n]),
                              speaker=request.extra.get("speaker"))
    return StageInput(request.request_id, sampling_params=request.extra.get("talker_sampling_params"),
                      cache_salt=request.cache_salt, payload=payload)


def talker2wav(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Talker codec tokens (cut before the first codec eos) -> token2wav input."""
    out = single_upstream(upstream, "talker2wav")
    codes = list(out.token_ids)
    for i, c in enumerate(codes):
        if c in CODEC_EOS_TOKENS:
            codes = codes[:i]
            break
    # none (the talker's eos came first): token2wav makes no audio (a reply that says nothing is no failure)
    return StageInput(request.request_id, prompt_token_ids=codes,
                      sampling_params=request.extra.get("token2wav_sampling_params"),
                      payload=CodesToWave(request.extra.get("speaker")))


def thinker2talker_chunk(chunk: StageDelta, request: StageInput, state: TalkerFeed) -> StageInput | None:
    """thinker2talker on a streaming edge (stages/common/talker_feed.py): nothing until the talker's prompt can
    be built (the thinker's prompt rows and its first two tokens), then the whole prompt at once, and afterwards
    only the new tokens and hidden rows."""
    fed = state.add(chunk, "thinker2talker", "qwen2_5_omni_thinker", ("hidden_states", "mrope_positions"))
    if fed is Fed.MORE:
        return StageInput(request.request_id, payload=reply_rows(chunk, "hidden_states"))
    if fed is Fed.WAIT:
        return None
    payload = ThinkerToTalker(prompt_ids=state.prompt, output_ids=list(state.gen),
                              hidden=state.joined("hidden_states"),
                              positions=state.joined("mrope_positions")[: len(state.prompt)],
                              speaker=request.extra.get("speaker"), streaming=not chunk.finished)
    return StageInput(request.request_id, sampling_params=request.extra.get("talker_sampling_params"),
                      cache_salt=request.cache_salt, payload=payload)


@dataclass(slots=True)
class CodesFeed:
    """talker2wav_chunk's state across one request's chunks."""

    started: bool = False
    ended: bool = False  # a codec eos came: nothing after it is audio


def talker2wav_chunk(chunk: StageDelta, request: StageInput, state: CodesFeed) -> StageInput | None:
    """talker2wav on a streaming edge: the new codec tokens, cut at the first codec eos."""
    if state.ended:
        return StageInput(request.request_id, prompt_token_ids=[])
    codes = []
    for c in chunk.token_ids:
        if c in CODEC_EOS_TOKENS:
            state.ended = True
            break
        codes.append(int(c))
    if not state.started:
        if not codes and not chunk.finished:
            return None
        state.started = True
        return StageInput(request.request_id, prompt_token_ids=codes,
                          sampling_params=request.extra.get("token2wav_sampling_params"),
                          payload=CodesToWave(request.extra.get("speaker")), input_complete=chunk.finished)
    return StageInput(request.request_id, prompt_token_ids=codes)
