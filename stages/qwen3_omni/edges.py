"""Qwen3-Omni: thinker -> talker (with its code predictor) -> code2wav, and the input processors between them.

    thinker   (stages/qwen3_omni/thinker.py)    text -> text tokens + per-token embeds / accept_hidden rows
    talker    (stages/qwen3_omni/talker.py)     thinker rows -> codec frames (first codebook sampled, the
                                                 rest from the code predictor)
    code2wav  (stages/qwen3_omni/code2wav.py)   codec frames -> 24 kHz waveform (no KV cache)

The processors (`fn(upstream, request) -> StageInput`, registered as qwen3_omni_thinker2talker /
qwen3_omni_talker2code2wav) run where the downstream stage runs, on plain numpy data: they only route
what the upstream produced. The talker's sampling parameters come from
`request.extra["talker_sampling_params"]`, the speaker from `request.extra["speaker"]` (default Ethan).
"""
from __future__ import annotations

import numpy as np

from omni.errors import REPLY_TOO_SHORT_TO_VOICE, RequestError
from omni.messages import StageDelta, StageInput, StageOutput

from stages.common.processors import single_upstream
from stages.qwen3_omni.code2wav import Qwen3OmniCode2WavStage
from stages.qwen3_omni.talker import Qwen3OmniTalkerStage
from stages.qwen3_omni.thinker import Qwen3OmniThinkerStage

__all__ = ["Qwen3OmniThinkerStage", "Qwen3OmniTalkerStage", "Qwen3OmniCode2WavStage", "thinker2talker",
           "thinker2talker_chunk", "talker2code2wav", "talker2code2wav_chunk"]


def thinker2talker(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Thinker output -> talker input: token ids and the per-token embeds / accept_hidden rows."""
    out = single_upstream(upstream, "qwen3_omni_thinker2talker")
    rows = out.mm_outputs or {}
    if "embeds" not in rows or "accept_hidden" not in rows:
        raise ValueError("qwen3_omni_thinker2talker: the thinker output carries no embeds / accept_hidden rows "
                         "(is the upstream a qwen3_omni_thinker stage?)")
    extra = {
        "thinker_prompt_ids": list(out.prompt_token_ids),
        "thinker_output_ids": list(out.token_ids),
        "thinker_embeds": np.asarray(rows["embeds"], dtype=np.float32),
        "thinker_accept_hidden": np.asarray(rows["accept_hidden"], dtype=np.float32),
        "thinker_mm_meta": np.asarray(rows["mm_meta"], dtype=np.float32) if "mm_meta" in rows else None,
        "speaker": request.extra.get("speaker"),
    }
    return StageInput(request.request_id, sampling_params=request.extra.get("talker_sampling_params"),
                      cache_salt=request.cache_salt, extra=extra)


def thinker2talker_chunk(chunk: StageDelta, request: StageInput, state: dict) -> StageInput | None:
    """thinker2talker on a streaming edge. The talker's prompt needs the thinker's prompt rows and the row of its
    first token g0 (computed once g1 is sampled): until then nothing is built (None); then the whole prompt at
    once, and afterwards only the new tokens and embeds rows (the talker turns each into one trailing row)."""
    if chunk.prompt_token_ids is not None:
        state["prompt"] = list(chunk.prompt_token_ids)
    rows = chunk.rows or {}
    if rows and ("embeds" not in rows or "accept_hidden" not in rows):
        raise ValueError("qwen3_omni_thinker2talker: the thinker chunk carries no embeds / accept_hidden rows "
                         "(is the upstream a qwen3_omni_thinker stage?)")
    if rows and chunk.rows_start != state.get("num_rows", 0):
        raise ValueError(f"qwen3_omni_thinker2talker: thinker rows from {chunk.rows_start}, expected "
                         f"{state.get('num_rows', 0)} (a chunk was lost)")
    state["num_rows"] = state.get("num_rows", 0) + (len(rows["embeds"]) if rows else 0)
    if state.get("started"):
        empty = np.zeros((0, 0), np.float32)
        return StageInput(request.request_id, extra={"thinker_output_ids": list(chunk.token_ids),
                                                     "thinker_embeds": rows.get("embeds", empty)})
    gen = state.setdefault("gen", [])
    gen.extend(chunk.token_ids)
    for name in ("embeds", "accept_hidden", "mm_meta"):
        if name in rows:
            state.setdefault(name, []).append(np.asarray(rows[name], dtype=np.float32))
    prompt = state.get("prompt")
    if prompt is None or len(gen) < 2 or state["num_rows"] < len(prompt) + 1:
        if chunk.finished:
            if len(gen) < 2:
                raise RequestError(f"qwen3_omni_thinker2talker: the talker needs >= 2 thinker tokens (the thinker "
                                   f"finished with {len(gen)})", code=REPLY_TOO_SHORT_TO_VOICE, actual=len(gen),
                                   limit=2)
            raise ValueError(f"qwen3_omni_thinker2talker: the talker needs >= 2 thinker tokens and their rows "
                             f"(the thinker finished with {len(gen)} tokens)")
        return None
    state["started"] = True
    extra = {
        "thinker_prompt_ids": prompt,
        "thinker_output_ids": list(gen),
        "thinker_embeds": np.concatenate(state["embeds"]),
        "thinker_accept_hidden": np.concatenate(state["accept_hidden"]),
        "thinker_mm_meta": np.concatenate(state["mm_meta"]) if state.get("mm_meta") else None,
        "speaker": request.extra.get("speaker"),
        "streaming": not chunk.finished,
    }
    return StageInput(request.request_id, sampling_params=request.extra.get("talker_sampling_params"),
                      cache_salt=request.cache_salt, extra=extra)


def _frames(rows: dict, num_prompt: int | None) -> np.ndarray:
    """The codec frames [N, G] among the talker's `codes` rows (prompt rows hold -1)."""
    if "codes" not in rows:
        raise ValueError("qwen3_omni_talker2code2wav: the talker output carries no `codes` rows "
                         "(is the upstream a qwen3_omni_talker stage?)")
    codes = np.asarray(rows["codes"])
    if num_prompt is not None:
        codes = codes[num_prompt:]
    return codes[codes[:, 0] >= 0].astype(np.int64)


def talker2code2wav(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Talker output -> code2wav input: every frame the talker generated (all codebooks), as transformers
    hands them to code2wav (the frame of the last sampled token, the codec eos, is never computed)."""
    out = single_upstream(upstream, "qwen3_omni_talker2code2wav")
    frames = _frames(out.mm_outputs or {}, len(out.prompt_token_ids))
    # none (the talker's eos came first): code2wav makes no audio (a reply that says nothing is no failure)
    return StageInput(request.request_id, prompt_token_ids=frames[:, 0].tolist(),
                      sampling_params=request.extra.get("code2wav_sampling_params"), extra={"codes": frames})


def talker2code2wav_chunk(chunk: StageDelta, request: StageInput, state: dict) -> StageInput | None:
    """talker2code2wav on a streaming edge: the frames of the generated positions computed since the last
    chunk (rows of prompt positions hold -1 and are skipped)."""
    frames = _frames(chunk.rows or {}, None) if chunk.rows else np.zeros((0, 0), np.int64)
    if not state.get("started"):
        if not len(frames) and not chunk.finished:
            return None
        state["started"] = True
        return StageInput(request.request_id, prompt_token_ids=frames[:, 0].tolist() if len(frames) else [],
                          sampling_params=request.extra.get("code2wav_sampling_params"),
                          extra={"codes": frames}, input_complete=chunk.finished)
    return StageInput(request.request_id, prompt_token_ids=frames[:, 0].tolist() if len(frames) else [],
                      extra={"codes": frames})
