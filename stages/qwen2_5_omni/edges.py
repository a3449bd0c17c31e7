"""Qwen2.5-Omni: thinker -> talker -> token2wav stages and the input processors between them.

    thinker   (stages/qwen2_5_omni/thinker.py)   text/image/audio -> text tokens + hidden states
    talker    (stages/qwen2_5_omni/talker.py)    thinker states -> codec tokens
    token2wav (stages/qwen2_5_omni/token2wav.py) codec tokens -> 24 kHz waveform (no KV cache)

Input processors (`fn(upstream, request) -> StageInput`, registered as thinker2talker / talker2wav)
run in the downstream stage's worker (where that stage runs) on plain numpy data: they only route
what the upstream stage produced. Their chunk forms (`*_chunk`) do the same on a streaming edge,
one upstream chunk at a time (see the talker's and token2wav's docstrings for what they do with it).
The talker's sampling parameters come from `request.extra["talker_sampling_params"]` (else the
stage defaults); the speaker from `request.extra["speaker"]` (default Chelsie).
"""
from __future__ import annotations

import numpy as np

from omni.errors import REPLY_TOO_SHORT_TO_VOICE, RequestError
from omni.messages import StageDelta, StageInput, StageOutput

from stages.common.processors import single_upstream
from stages.qwen2_5_omni.talker import Qwen2_5OmniTalkerStage
from stages.qwen2_5_omni.thinker import Qwen2_5OmniThinkerStage
from stages.qwen2_5_omni.token2wav import Qwen2_5OmniToken2WavStage

__all__ = ["Qwen2_5OmniThinkerStage", "Qwen2_5OmniTalkerStage", "Qwen2_5OmniToken2WavStage",
           "thinker2talker", "talker2wav", "thinker2talker_chunk", "talker2wav_chunk", "CODEC_EOS_TOKENS"]

# transformers' generate stops the talker at either token and cuts the codes before the first one.
CODEC_EOS_TOKENS = (8292, 8294)


def thinker2talker(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Thinker output -> talker input: token ids, last hidden states and 3-D rotary positions."""
    out = single_upstream(upstream, "thinker2talker")
    if out.hidden_states is None or "mrope_positions" not in out.mm_outputs:
        raise ValueError("thinker2talker: the thinker output carries no hidden states / mrope_positions "
                         "(is the upstream a qwen2_5_omni_thinker stage?)")
    n = len(out.prompt_token_ids)
    extra = {
        "thinker_prompt_ids": list(out.prompt_token_ids),
        "thinker_output_ids": list(out.token_ids),
        "thinker_hidden": np.asarray(out.hidden_states, dtype=np.float32),
        "thinker_positions": np.asarray(out.mm_outputs["mrope_positions"][:n]),
        "speaker": request.extra.get("speaker"),
    }
    return StageInput(request.request_id, sampling_params=request.extra.get("talker_sampling_params"),
                      cache_salt=request.cache_salt, extra=extra)


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
                      extra={"speaker": request.extra.get("speaker")})


def thinker2talker_chunk(chunk: StageDelta, request: StageInput, state: dict) -> StageInput | None:
    """thinker2talker on a streaming edge. The talker's prompt needs the thinker's prompt rows and
    its first two tokens (reply row 0 is the hidden row of g0): until then nothing is built (None);
    then the whole prompt at once, and afterwards only the new tokens and hidden rows."""
    if chunk.prompt_token_ids is not None:
        state["prompt"] = list(chunk.prompt_token_ids)
    gen = state.setdefault("gen", [])
    gen.extend(chunk.token_ids)
    rows = chunk.rows
    if chunk.rows and ("hidden_states" not in rows or "mrope_positions" not in rows):
        raise ValueError("thinker2talker: the thinker chunk carries no hidden states / mrope_positions "
                         "(is the upstream a qwen2_5_omni_thinker stage?)")
    if state.get("started"):
        return StageInput(request.request_id, extra={
            "thinker_output_ids": list(chunk.token_ids),
            "thinker_hidden": rows.get("hidden_states", np.zeros((0, 0), np.float32))})
    for name in ("hidden_states", "mrope_positions"):
        if name in rows:
            state.setdefault(name, []).append(np.asarray(rows[name], dtype=np.float32))
    prompt = state.get("prompt")
    hidden = np.concatenate(state["hidden_states"]) if state.get("hidden_states") else None
    if prompt is None or hidden is None or len(gen) < 2 or hidden.shape[0] < len(prompt) + 1:
        if chunk.finished:
            if len(gen) < 2:
                raise RequestError(f"thinker2talker: the talker needs >= 2 thinker tokens (the thinker finished "
                                   f"with {len(gen)})", code=REPLY_TOO_SHORT_TO_VOICE, actual=len(gen), limit=2)
            raise ValueError(f"thinker2talker: the talker needs >= 2 thinker tokens and their hidden states "
                             f"(the thinker finished with {len(gen)} tokens)")
        return None
    state["started"] = True
    n = len(prompt)
    extra = {
        "thinker_prompt_ids": prompt,
        "thinker_output_ids": list(gen),
        "thinker_hidden": hidden,
        "thinker_positions": np.concatenate(state["mrope_positions"])[:n],
        "speaker": request.extra.get("speaker"),
        "streaming": not chunk.finished,
    }
    return StageInput(request.request_id, sampling_params=request.extra.get("talker_sampling_params"),
                      cache_salt=request.cache_salt, extra=extra)


def talker2wav_chunk(chunk: StageDelta, request: StageInput, state: dict) -> StageInput | None:
    """talker2wav on a streaming edge: the new codec tokens, cut at the first codec eos."""
    if state.get("ended"):
        return StageInput(request.request_id, prompt_token_ids=[])
    codes = []
    for c in chunk.token_ids:
        if c in CODEC_EOS_TOKENS:
            state["ended"] = True
            break
        codes.append(int(c))
    if not state.get("started"):
        if not codes and not chunk.finished:
            return None
        state["started"] = True
        return StageInput(request.request_id, prompt_token_ids=codes,
                          sampling_params=request.extra.get("token2wav_sampling_params"),
                          extra={"speaker": request.extra.get("speaker")}, input_complete=chunk.finished)
    return StageInput(request.request_id, prompt_token_ids=codes)
