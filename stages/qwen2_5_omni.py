"""Qwen2.5-Omni: thinker -> talker -> token2wav stages and the input processors between them.

    thinker   (stages/qwen2_5_omni_thinker.py)   text/image/audio -> text tokens + hidden states
    talker    (stages/qwen2_5_omni_talker.py)    thinker states -> codec tokens
    token2wav (stages/qwen2_5_omni_token2wav.py) codec tokens -> 24 kHz waveform (no KV cache)

Input processors (`fn(upstream, request) -> StageInput`, registered as thinker2talker / talker2wav)
run in the downstream stage's worker (where that stage runs) on plain numpy data: they only route
what the upstream stage produced.
The talker's sampling parameters come from `request.extra["talker_sampling_params"]` (else the
stage defaults); the speaker from `request.extra["speaker"]` (default Chelsie).
"""
from __future__ import annotations

import numpy as np

from omni.outputs import StageInput, StageOutput

from .qwen2_5_omni_talker import Qwen2_5OmniTalkerStage
from .qwen2_5_omni_thinker import Qwen2_5OmniThinkerStage
from .qwen2_5_omni_token2wav import Qwen2_5OmniToken2WavStage

__all__ = ["Qwen2_5OmniThinkerStage", "Qwen2_5OmniTalkerStage", "Qwen2_5OmniToken2WavStage",
           "thinker2talker", "talker2wav", "CODEC_EOS_TOKENS"]

# transformers' generate stops the talker at either token and cuts the codes before the first one.
CODEC_EOS_TOKENS = (8292, 8294)


def _single(upstream: dict[str, StageOutput], edge: str) -> StageOutput:
    if len(upstream) != 1:
        raise ValueError(f"{edge}: expects exactly one upstream stage, got {sorted(upstream)}")
    out = next(iter(upstream.values()))
    if out.error is not None:
        raise ValueError(f"{edge}: upstream stage {out.stage} failed: {out.error}")
    return out


def thinker2talker(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Thinker output -> talker input: token ids, last hidden states and 3-D rotary positions."""
    out = _single(upstream, "thinker2talker")
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
    out = _single(upstream, "talker2wav")
    codes = list(out.token_ids)
    for i, c in enumerate(codes):
        if c in CODEC_EOS_TOKENS:
            codes = codes[:i]
            break
    if not codes:
        raise ValueError("talker2wav: the talker produced no codec tokens before its eos")
    return StageInput(request.request_id, prompt_token_ids=codes,
                      sampling_params=request.extra.get("token2wav_sampling_params"),
                      extra={"speaker": request.extra.get("speaker")})
