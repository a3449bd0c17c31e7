"""Qwen3-Omni: thinker -> talker (with its code predictor) -> code2wav, and the input processors between them.

    thinker   (stages/qwen3_omni/thinker.py)    text -> text tokens + per-token embeds / accept_hidden rows
    talker    (stages/qwen3_omni/talker.py)     thinker rows -> codec frames (first codebook sampled, the
                                                 rest from the code predictor)
    code2wav  (stages/qwen3_omni/code2wav.py)   codec frames -> 24 kHz waveform (no KV cache)

The processors (`fn(upstream, request) -> StageInput`, registered as qwen3_omni_thinker2talker /
qwen3_omni_talker2code2wav) run where the downstream stage runs, on plain numpy data: they only route
what the upstream produced, as typed payloads (stages/qwen3_omni/payloads.py). The talker's sampling
parameters come from the caller's `request.extra["talker_sampling_params"]`, the speaker from
`request.extra["speaker"]` (default Ethan).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni.messages import StageDelta, StageInput, StageOutput

from stages.common.processors import single_upstream
from stages.common.talker_feed import Fed, TalkerFeed, reply_rows
from stages.qwen3_omni.code2wav import Qwen3OmniCode2WavStage
from stages.qwen3_omni.payloads import FramesToWave, ThinkerToTalker
from stages.qwen3_omni.talker import Qwen3OmniTalkerStage
from stages.qwen3_omni.thinker import Qwen3OmniThinkerStage

__all__ = ["Qwen3OmniThinkerStage", "Qwen3OmniTalkerStage", "Qwen3OmniCode2WavStage", "thinker2talker",
           "thinker2talker_chunk", "talker2code2wav", "talker2code2wav_chunk", "FramesFeed"]


EDGE = "qwen3_omni_thinker2talker"


def thinker2talker(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Thinker output -> talker input: token ids and the per-token embeds / accept_hidden rows."""
    out = single_upstream(upstream, EDGE)
    rows = out.mm_outputs or {}
    if "embeds" not in rows or "accept_hidden" not in rows:
        raise ValueError(f"{EDGE}: the thinker output carries no embeds / accept_hidden rows "
                         "(is the upstream a qwen3_omni_thinker stage?)")
    payload = ThinkerToTalker(
        prompt_ids=list(out.prompt_token_ids), output_ids=list(out.token_ids),
        embeds=np.asarray(rows["embeds"], dtype=np.float32),
        accept_hidden=np.asarray(rows["accept_hidden"], dtype=np.float32),
        mm_meta=np.asarray(rows["mm_meta"], dtype=np.float32) if "mm_meta" in rows else None,
        speaker=request.extra.get("speaker"))
    return StageInput(request.request_id, sampling_params=request.extra.get("talker_sampling_params"),
                      cache_salt=request.cache_salt, payload=payload)


def thinker2talker_chunk(chunk: StageDelta, request: StageInput, state: TalkerFeed) -> StageInput | None:
    """thinker2talker on a streaming edge (stages/common/talker_feed.py): nothing until the talker's prompt can
    be built (the thinker's prompt rows and the row of its first token g0, computed once g1 is sampled), then the
    whole prompt at once, and afterwards only the new tokens and embeds rows (the talker turns each into one
    trailing row)."""
    fed = state.add(chunk, EDGE, "qwen3_omni_thinker", ("embeds", "accept_hidden"), ("mm_meta",))
    if fed is Fed.MORE:
        return StageInput(request.request_id, payload=reply_rows(chunk, "embeds"))
    if fed is Fed.WAIT:
        return None
    payload = ThinkerToTalker(prompt_ids=state.prompt, output_ids=list(state.gen), embeds=state.joined("embeds"),
                              accept_hidden=state.joined("accept_hidden"), mm_meta=state.joined("mm_meta"),
                              speaker=request.extra.get("speaker"), streaming=not chunk.finished)
    return StageInput(request.request_id, sampling_params=request.extra.get("talker_sampling_params"),
                      cache_salt=request.cache_salt, payload=payload)


def _frames(rows: dict, num_prompt: int | None) -> np.ndarray:
    """The codec frames [N, G] among the talker's `codes` rows (prompt rows hold -1)."""
    if "codes" not in rows:
        raise ValueError("qwen3_omni_talker2code2wav: the talker output carries no `codes` rows "
                         "(is the upstream a qwen3_omni_talker stage?)")
    codes = np.asarray(rows["codes"])
    if num_prompt is not None:
        codes = codes[num_prompt:]
    return codes[codes[:, 0] >= 0].astype(np.int64)


def _frames_input(request: StageInput, frames: np.ndarray, **kwargs) -> StageInput:
    return StageInput(request.request_id, prompt_token_ids=frames[:, 0].tolist() if len(frames) else [],
                      payload=FramesToWave(frames), **kwargs)


def talker2code2wav(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Talker output -> code2wav input: every frame the talker generated (all codebooks), as transformers
    hands them to code2wav (the frame of the last sampled token, the codec eos, is never computed)."""
    out = single_upstream(upstream, "qwen3_omni_talker2code2wav")
    frames = _frames(out.mm_outputs or {}, len(out.prompt_token_ids))
    # none (the talker's eos came first): code2wav makes no audio (a reply that says nothing is no failure)
    return _frames_input(request, frames, sampling_params=request.extra.get("code2wav_sampling_params"))


@dataclass(slots=True)
class FramesFeed:
    """talker2code2wav_chunk's state across one request's chunks."""

    started: bool = False


def talker2code2wav_chunk(chunk: StageDelta, request: StageInput, state: FramesFeed) -> StageInput | None:
    """talker2code2wav on a streaming edge: the frames of the generated positions computed since the last
    chunk (rows of prompt positions hold -1 and are skipped)."""
    frames = _frames(chunk.rows or {}, None) if chunk.rows else np.zeros((0, 0), np.int64)
    if state.started:
        return _frames_input(request, frames)
    if not len(frames) and not chunk.finished:
        return None
    state.started = True
    return _frames_input(request, frames, sampling_params=request.extra.get("code2wav_sampling_params"),
                         input_complete=chunk.finished)
