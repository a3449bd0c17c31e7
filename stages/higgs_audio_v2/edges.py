"""Higgs Audio v2: LLM -> codec, and the input processor between them.

    model  (stages/higgs_audio_v2/model.py)   text + reference voices -> delayed audio frames, one a step
    codec  (stages/higgs_audio_v2/codec.py)   aligned codec frames -> 24 kHz waveform (no KV cache)

The processor (`higgs_audio_v2_to_codec`, registered in stages/__init__.py) reads the model's `audio_codes` rows
and does what `HiggsAudioV2Processor.batch_decode` does before its codec call: the frames after the generation's
all-stream-bos frame up to the all-stream-eos frame, the delay pattern reverted, codes clipped to the codebook (a
request that spoke several turns: each turn's run so, one after another). On a streaming edge an aligned frame goes
on as soon as the K - 1 frames after it exist, so the pieces joined are the one-shot frames. (batch_decode starts
after the *last* all-bos frame of the sequence; a generation starts with one, and a model that emitted another
all-bos frame inside a run would be cut there by transformers and not here.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omni.messages import StageDelta, StageInput, StageOutput

from stages.common.processors import single_upstream
from stages.higgs_audio_v2.codec import HiggsAudioV2CodecStage
from stages.higgs_audio_v2.model import HiggsAudioV2Stage
from stages.higgs_audio_v2.payloads import CodesToWave

__all__ = ["HiggsAudioV2Stage", "HiggsAudioV2CodecStage", "model2codec", "model2codec_chunk", "DelayedFrames"]

EDGE = "higgs_audio_v2_to_codec"


def _generated(rows: dict) -> np.ndarray:
    """The frames among the model's `audio_codes` rows (positions that sampled none hold -1)."""
    if "audio_codes" not in rows:
        raise ValueError(f"{EDGE}: the upstream output carries no `audio_codes` rows (is it a higgs_audio_v2 stage?)")
    codes = np.asarray(rows["audio_codes"])
    return codes[codes[:, 0] >= 0].astype(np.int64)


def _input(request: StageInput, codes: np.ndarray, **kwargs) -> StageInput:
    return StageInput(request.request_id, prompt_token_ids=codes[:, 0].tolist() if len(codes) else [],
                      payload=CodesToWave(codes), **kwargs)


@dataclass(slots=True)
class DelayedFrames:
    """The generated frames of one request, aligned as they come (also the streaming edge's chunk state). A request
    that speaks several turns (a text edge's pieces) generates one delayed run per turn, each from an all-bos frame to
    an all-eos one: each is aligned on its own and the codes follow one another."""

    stream_bos: int = -1
    stream_eos: int = -1
    frames: list[np.ndarray] = field(default_factory=list)  # the current run's, after its all-bos frame
    started: bool = False
    sent: int = 0  # aligned frames of the current run handed on
    done: list[np.ndarray] = field(default_factory=list)  # aligned frames of ended runs, not handed on yet
    input_started: bool = False

    def add(self, frames: np.ndarray) -> None:
        for f in frames:
            if not self.started:
                self.started = bool((f == self.stream_bos).all())
            elif (f == self.stream_eos).all():
                self.done.append(self._aligned())
                self.frames, self.sent, self.started = [], 0, False
            else:
                self.frames.append(f)

    def aligned(self) -> np.ndarray:
        """The aligned frames not handed on yet (frame t needs frames t .. t + K - 1 of its run)."""
        rows = [*self.done, self._aligned()]
        self.done = []
        rows = [r for r in rows if len(r)]
        if not rows:
            return np.zeros((0, max(len(self.frames[0]) if self.frames else 0, 0)), np.int64)
        return np.clip(np.concatenate(rows), 0, self.stream_bos - 1)

    def _aligned(self) -> np.ndarray:
        k = self.frames[0].shape[0] if self.frames else 0
        ready = max(0, len(self.frames) - k + 1) if k else 0
        if ready <= self.sent:
            return np.zeros((0, k), np.int64)
        rows = np.stack([np.stack([self.frames[t + i][i] for i in range(k)]) for t in range(self.sent, ready)])
        self.sent = ready
        return rows.astype(np.int64)

    def know(self, frames: np.ndarray) -> None:
        """Stream bos / eos from the generation's first frame: the delay pattern forces it all stream-bos, and
        stream-eos is stream-bos + 1 in every Higgs config (1024 / 1025)."""
        if self.stream_bos < 0 and len(frames):
            self.stream_bos = int(frames[0, 0])
            self.stream_eos = self.stream_bos + 1


def model2codec(upstream: dict[str, StageOutput], request: StageInput) -> StageInput:
    """Model output -> codec input: every aligned frame of the generation (none: the codec makes no audio)."""
    out = single_upstream(upstream, EDGE)
    frames = _generated(out.mm_outputs or {})
    feed = DelayedFrames()
    feed.know(frames)
    feed.add(frames)
    return _input(request, feed.aligned(), sampling_params=request.extra.get("codec_sampling_params"))


def model2codec_chunk(chunk: StageDelta, request: StageInput, state: DelayedFrames) -> StageInput | None:
    """model2codec on a streaming edge: the aligned frames that the frames computed since the last chunk complete
    (the first input waits for the first aligned frame, or the end)."""
    frames = _generated(chunk.rows) if chunk.rows else np.zeros((0, 0), np.int64)
    state.know(frames)
    state.add(frames)
    codes = state.aligned()
    if state.input_started:
        return _input(request, codes)
    if not len(codes) and not chunk.finished:
        return None
    state.input_started = True
    return _input(request, codes, sampling_params=request.extra.get("codec_sampling_params"),
                  input_complete=chunk.finished)
