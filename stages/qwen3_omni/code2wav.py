"""Qwen3-Omni code2wav as a (non-autoregressive) stage: codec frames [N, num_quantizers] -> 24 kHz waveform.

transformers' `Qwen3OmniMoeCode2Wav` is causal (a sliding-window transformer, causal convolutions and
transposed convolutions), so a waveform can be made chunk by chunk: `chunked_decode(codes, chunk_size,
left_context_size)` decodes frames [s - ctx, e) and keeps the samples of [s, e). This stage runs
exactly that:

    one shot   chunked_decode(frames, chunk_frames, left_context_frames) (transformers' generate uses
               300 / 25: the default here), bitwise transformers' waveform
    streaming  (a `stream: true` edge from the talker) windows decoded as soon as their frames have
               arrived, sized by the common schedule (stages/common/audio_chunks.py): `first_chunk_frames`,
               then `chunk_frames` doubling up to `max_chunk_frames`, a short last chunk on its own. With
               first_chunk_frames == chunk_frames == max_chunk_frames the concatenated pieces are
               chunked_decode's waveform, bitwise; any chunking differs from the one-shot `forward` only
               where a window's left context is shorter than the model's receptive field.

    model_kwargs: chunk_frames (300), first_chunk_frames (chunk_frames), max_chunk_frames (chunk_frames),
                  left_context_frames (25); the one-shot path decodes in windows of max_chunk_frames

Frames arrive in `StageInput.payload` (a FramesToWave: [N, G] ints; `prompt_token_ids` carries the first
codebook for the engine's bookkeeping).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni.engine.stage_model import OneShotStageModel
from omni.errors import RequestError
from omni.messages import StageInput

from stages.common.audio_chunks import ChunkSchedule
from stages.common.processors import expect_payload
from stages.qwen3_omni.info import CODE2WAV
from stages.qwen3_omni.loading import load_qwen3_omni_part
from stages.qwen3_omni.payloads import FramesToWave


@dataclass(slots=True)
class _CodeStream:
    frames: list[np.ndarray] = field(default_factory=list)  # [k, G] pieces as they arrived
    total: int = 0
    done: int = 0  # frames whose audio has been emitted
    complete: bool = False
    finished: bool = False
    pieces: list[np.ndarray] = field(default_factory=list)
    _all: np.ndarray | None = None

    def codes(self) -> np.ndarray:
        if self._all is None or self._all.shape[0] != self.total:
            self._all = np.concatenate(self.frames) if self.frames else np.zeros((0, 0), np.int64)
        return self._all


def _codes(inp: StageInput) -> np.ndarray | None:
    """The frames qwen3_omni_talker2code2wav hands on (no payload: none)."""
    return None if inp.payload is None else expect_payload(inp, FramesToWave, "qwen3_omni_talker2code2wav").codes


class Qwen3OmniCode2WavStage(OneShotStageModel):
    checkpoint_prefix = "code2wav."  # its tensors in the full checkpoint (the planner reads their headers)
    info = CODE2WAV
    tokenizer = None
    eos_token_id = None
    sampling_rate = 24000

    def __init__(self, code2wav, device: torch.device, chunk_frames: int = 300, first_chunk_frames: int | None = None,
                 left_context_frames: int = 25, max_chunk_frames: int | None = None):
        self.code2wav = code2wav
        self.device = device
        self.dtype = torch.float32
        cfg = code2wav.config
        self.num_groups = int(cfg.num_quantizers)
        self.codebook_size = int(cfg.codebook_size)
        self.vocab_size = self.codebook_size
        self.hidden_size = cfg.hidden_size
        self.max_model_len = int(cfg.max_position_embeddings)
        self.samples_per_frame = int(code2wav.total_upsample)
        self.schedule = ChunkSchedule.from_kwargs("frames", chunk_frames, first_chunk_frames, max_chunk_frames)
        self.left_context_frames = int(left_context_frames)
        if self.left_context_frames < 0:
            raise ValueError(f"model_kwargs.left_context_frames: must be >= 0, got {self.left_context_frames}")

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        kwargs = dict(model_kwargs or {})
        chunking = {k: kwargs.pop(k) for k in ("chunk_frames", "first_chunk_frames", "max_chunk_frames",
                                               "left_context_frames") if k in kwargs}
        model, _ = load_qwen3_omni_part(Path(model_path), "code2wav", Qwen3OmniMoeCode2Wav, torch.float32, device,
                                        **kwargs)
        return cls(model, device, **chunking)

    def check_frames(self, value: Any, have: int = 0) -> np.ndarray:
        arr = np.asarray(value if value is not None else np.zeros((0, self.num_groups)))
        if arr.size == 0:
            return np.zeros((0, self.num_groups), np.int64)
        if arr.ndim != 2 or arr.shape[1] != self.num_groups:
            raise RequestError(f"payload.codes: expected [frames, {self.num_groups}] codec frames, got shape "
                               f"{list(arr.shape)}", field="payload.codes")
        if not np.issubdtype(arr.dtype, np.integer) and not np.array_equal(arr, np.round(arr)):
            raise RequestError("payload.codes: codec frames must be integers", field="payload.codes")
        arr = arr.astype(np.int64)
        bad = arr[(arr < 0) | (arr >= self.codebook_size)]
        if bad.size:
            raise RequestError(f"payload.codes: code {int(bad[0])} is out of range (0..{self.codebook_size - 1})",
                               field="payload.codes", limit=self.codebook_size, actual=int(bad[0]))
        if have + arr.shape[0] > self.max_model_len:
            raise RequestError(f"payload.codes: {have + arr.shape[0]} frames, at most {self.max_model_len} allowed",
                               field="payload.codes")
        return arr

    @torch.inference_mode()
    def decode_window(self, codes: np.ndarray, start: int, end: int) -> np.ndarray:
        """Samples of frames [start, end), decoded with chunked_decode's left context (as its loop body does)."""
        ctx = self.left_context_frames if start - self.left_context_frames > 0 else start
        x = torch.from_numpy(np.ascontiguousarray(codes[start - ctx : end].T))[None].to(self.device)
        wav = self.code2wav(x)
        return wav[..., ctx * self.samples_per_frame :].reshape(-1).float().cpu().numpy()

    @torch.inference_mode()
    def generate(self, codes: np.ndarray) -> np.ndarray:
        """Frames [N, G] -> float32 waveform: transformers' chunked_decode in windows of max_chunk_frames (the
        steady streamed size; nobody listens to a one-shot waveform before it ends, so no window is small)."""
        x = torch.from_numpy(np.ascontiguousarray(codes.T))[None].to(self.device)
        wav = self.code2wav.chunked_decode(x, chunk_size=self.schedule.cap,
                                           left_context_size=self.left_context_frames)
        return wav.reshape(-1).float().cpu().numpy()

    def profile_inputs(self, lengths: list[int]) -> list[StageInput]:
        """Requests of `lengths` codec frames (at most max_model_len), as qwen3_omni_talker2code2wav hands them
        over: omni plan's profile step (the default inputs carry token ids only, no frames)."""
        out = []
        for i, n in enumerate(lengths):
            frames = np.zeros((max(1, min(n, self.max_model_len)), self.num_groups), np.int64)
            out.append(StageInput(f"__profile_code2wav_{i}", prompt_token_ids=frames[:, 0].tolist(),
                                  payload=FramesToWave(frames)))
        return out

    # -- OneShotStageEngine hooks ---------------------------------------------
    def prepare_generation(self, inp: StageInput, seed: int) -> np.ndarray:
        return self.check_frames(_codes(inp))  # none: no audio (the talker's eos came first)

    def run_generation(self, job: np.ndarray) -> dict[str, Any]:
        audio = self.generate(job) if len(job) else np.zeros(0, np.float32)
        return {"audio": audio, "sampling_rate": self.sampling_rate}

    # -- streaming --------------------------------------------------------------
    def prepare_stream(self, inp: StageInput, seed: int) -> _CodeStream:
        state = _CodeStream()
        self._add(state, inp)
        return state

    def _add(self, state: _CodeStream, inp: StageInput) -> None:
        frames = self.check_frames(_codes(inp), state.total)
        if len(frames):
            state.frames.append(frames)
            state.total += len(frames)

    def extend_stream(self, state: _CodeStream, inp: StageInput, last: bool) -> None:
        if state.complete:
            raise RequestError("payload.codes: this request's frames are complete", field="payload.codes")
        self._add(state, inp)
        state.complete = last  # with no frames at all: one empty last piece (no audio)

    def _next_end(self, state: _CodeStream) -> int | None:
        """End (exclusive) of the next chunk of frames, or None while it cannot be made yet (causal: a chunk
        needs no look-ahead)."""
        if state.finished:
            return None
        return self.schedule.next_end(len(state.pieces), state.done, state.total, state.complete)

    def chunk_size(self, index: int) -> int:
        """Frames in a stream's chunk number `index` (stages/common/audio_chunks.py)."""
        return self.schedule.size(index)

    def stream_ready(self, state: _CodeStream) -> bool:
        return self._next_end(state) is not None

    def next_output(self, state: _CodeStream) -> tuple[dict[str, Any] | None, bool]:
        end = self._next_end(state)
        if end is None:
            return None, state.finished
        start = state.done
        piece = self.decode_window(state.codes(), start, end) if end > start else np.zeros(0, np.float32)
        state.pieces.append(piece)
        state.done = end
        state.finished = state.complete and end >= state.total
        return {"audio": piece, "sampling_rate": self.sampling_rate}, state.finished

    def stream_result(self, state: _CodeStream) -> dict[str, Any]:
        audio = np.concatenate(state.pieces) if state.pieces else np.zeros(0, np.float32)
        return {"audio": audio.astype(np.float32), "sampling_rate": self.sampling_rate}
