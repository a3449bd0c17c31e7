"""Higgs Audio v2's codec as a (non-autoregressive) stage: audio frames [T, K] -> 24 kHz waveform.

    one shot   all frames decoded at once: transformers' `HiggsAudioV2TokenizerModel.decode` (the processor's
               batch_decode runs it on the frames once the delay pattern is undone and the codes clipped); a
               step's requests of equal length decode as one batch (of at most max_num_batched_tokens frames)
    streaming  (a `stream: true` edge from the LLM) frames [s, e) are decoded on the window
               [s - left_context_frames, e + right_context_frames) as soon as those frames exist (the whole
               rest at the end) and the samples of [s, e) kept. The DAC decoder is not causal: every
               convolution is centred, so a window needs context on BOTH sides; with both contexts at least
               the decoder's reach (HiggsCodec.decoder_reach_frames, the default) every window's samples are
               the one-shot decode's up to the rounding of a differently sized convolution, and the pieces
               joined have the one-shot length. Chunk sizes follow the common schedule
               (stages/common/audio_chunks.py): `first_chunk_frames`, then `chunk_frames` doubling up to
               `max_chunk_frames`, a short last chunk on its own.

    model_kwargs: chunk_frames (25), first_chunk_frames (8), max_chunk_frames (100), left_context_frames and
                  right_context_frames (the decoder's reach), first_right_context_frames (the first window's:
                  right_context_frames; fewer brings the first audio sooner, at the cost of that window's last
                  samples), max_frames (4096)

Streamed windows are the engine's work items (`pieces_span_steps`, omni/engine/in_flight.py): each is one decode,
and the windows in flight of several streams that have the same length decode as one batch (others alone).

The frames arrive in `StageInput.payload` (a CodesToWave [T, K] of ints; a request without one has no audio).
The codec runs in float32 whatever the stage's dtype, as transformers runs it.
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
from stages.higgs_audio_v2.codec_model import HiggsCodec
from stages.higgs_audio_v2.codec_weights import codec_directory
from stages.higgs_audio_v2.info import CODEC
from stages.higgs_audio_v2.payloads import CodesToWave

PROCESSOR = "higgs_audio_v2_to_codec"  # the input processor that makes CodesToWave, as errors name it


@dataclass(slots=True, eq=False)
class _CodeStream:
    """One request whose frames arrive in chunks."""

    frames: list[np.ndarray] = field(default_factory=list)  # [n, K] pieces as they arrived
    total: int = 0
    done: int = 0  # frames whose window has been cut (its samples emitted or at the finish step)
    windows: int = 0  # windows cut (the next chunk's size follows from it)
    last_cut: bool = False
    complete: bool = False

    def codes(self, lo: int, hi: int) -> np.ndarray:
        if len(self.frames) > 1:
            self.frames = [np.concatenate(self.frames)]
        return self.frames[0][lo:hi]


@dataclass(slots=True, eq=False)
class _Window:
    """A stream's chunk [start, end) of frames (the engine's work item), decoded on [lo, hi)."""

    stream: _CodeStream
    start: int
    end: int
    lo: int
    hi: int
    codes: np.ndarray | None  # [hi - lo, K]; None: an empty last piece
    audio: np.ndarray | None = None  # the chunk's samples, once decoded


class HiggsAudioV2CodecStage(OneShotStageModel):
    info = CODEC
    pieces_span_steps = True
    tokenizer = None
    eos_token_id = None

    def __init__(self, codec: HiggsCodec, device: torch.device, chunk_frames: int = 25,
                 first_chunk_frames: int | None = 8, max_chunk_frames: int | None = 100,
                 left_context_frames: int | None = None, right_context_frames: int | None = None,
                 first_right_context_frames: int | None = None, max_frames: int = 4096):
        self.codec = codec
        self.device = device
        self.dtype = torch.float32
        self.sampling_rate = codec.sample_rate
        self.num_codebooks = codec.num_quantizers
        self.codebook_size = codec.codebook_size
        self.vocab_size = self.codebook_size
        self.hop_length = codec.hop_length
        self.max_model_len = int(max_frames)
        self.schedule = ChunkSchedule.from_kwargs("frames", chunk_frames, first_chunk_frames, max_chunk_frames)
        reach = codec.decoder_reach_frames()
        self.left_context_frames = reach if left_context_frames is None else int(left_context_frames)
        self.right_context_frames = reach if right_context_frames is None else int(right_context_frames)
        self.first_right_context_frames = (self.right_context_frames if first_right_context_frames is None
                                           else int(first_right_context_frames))
        for name in ("left_context_frames", "right_context_frames", "first_right_context_frames"):
            if getattr(self, name) < 0:
                raise ValueError(f"model_kwargs.{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_model_len < 1:
            raise ValueError(f"model_kwargs.max_frames: must be >= 1, got {self.max_model_len}")

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        """The codec of `model_path`: a codec directory, or a whole Higgs Audio v2 directory with its codec in
        `audio_tokenizer/` or where its processor_config.json says (codec_weights.codec_directory)."""
        path = codec_directory(model_path)
        if path is None:
            raise FileNotFoundError(f"{model_path}: no Higgs Audio v2 codec (a codec's config.json, an "
                                    "audio_tokenizer/ folder, or a local folder named by processor_config.json's audio_tokenizer)")
        return cls(HiggsCodec.from_pretrained(path, device=device, dtype=torch.float32), device,
                   **(model_kwargs or {}))

    def check_codes(self, value: Any, have: int = 0) -> np.ndarray:
        """[n, K] int64 frames, or a RequestError naming payload.codes and the numbers."""
        arr = np.asarray(value if value is not None else np.zeros((0, self.num_codebooks), np.int64))
        if arr.size == 0:
            return np.zeros((0, self.num_codebooks), np.int64)
        if arr.ndim != 2 or arr.shape[1] != self.num_codebooks:
            raise RequestError(f"payload.codes: expected [frames, {self.num_codebooks}] codec frames, got shape "
                               f"{list(arr.shape)}", field="payload.codes", limit=self.num_codebooks,
                               actual=arr.shape[-1] if arr.ndim else 0)
        if not np.issubdtype(arr.dtype, np.integer):
            raise RequestError(f"payload.codes: codec frames must be integers, got {arr.dtype}", field="payload.codes")
        arr = arr.astype(np.int64)
        bad = arr[(arr < 0) | (arr >= self.codebook_size)]
        if bad.size:
            raise RequestError(f"payload.codes: code {int(bad[0])} is out of range (0..{self.codebook_size - 1})",
                               field="payload.codes", limit=self.codebook_size, actual=int(bad[0]))
        if have + arr.shape[0] > self.max_model_len:
            raise RequestError(f"payload.codes: {have + arr.shape[0]} frames, at most {self.max_model_len} allowed",
                               field="payload.codes", limit=self.max_model_len, actual=have + arr.shape[0])
        return arr

    def _codes(self, inp: StageInput, have: int = 0) -> np.ndarray:
        value = None if inp.payload is None else expect_payload(inp, CodesToWave, PROCESSOR).codes
        return self.check_codes(value, have)

    @torch.inference_mode()
    def decode_batch(self, windows: list[np.ndarray], max_frames: int | None = None) -> list[np.ndarray]:
        """Each [n, K] window's waveform: windows of one length decode as one batch of at most `max_frames`
        frames in all (None: no bound; a longer window alone), the others alone."""
        out: list[np.ndarray | None] = [None] * len(windows)
        by_length: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_length.setdefault(len(w), []).append(i)
        for length, idx in by_length.items():
            per_call = len(idx) if max_frames is None else max(1, max_frames // max(1, length))
            for first in range(0, len(idx), per_call):
                part = idx[first : first + per_call]
                codes = torch.from_numpy(np.stack([windows[i].T for i in part])).to(self.device)
                wave = self.codec.decode(codes)[:, 0].float().cpu().numpy()
                for row, i in enumerate(part):
                    out[i] = wave[row]
        return out

    def profile_inputs(self, lengths: list[int]) -> list[StageInput]:
        """Requests of `lengths` frames (at most max_model_len), as the LLM's processor hands them over."""
        out = []
        for i, n in enumerate(lengths):
            frames = np.zeros((max(1, min(n, self.max_model_len)), self.num_codebooks), np.int64)
            out.append(StageInput(f"__profile_higgs_codec_{i}", prompt_token_ids=frames[:, 0].tolist(),
                                  payload=CodesToWave(frames)))
        return out

    # -- OneShotStageEngine hooks ---------------------------------------------
    def prepare_generation(self, inp: StageInput, seed: int) -> np.ndarray:
        return self._codes(inp)

    def run_generation(self, job: np.ndarray) -> dict[str, Any]:
        return self.run_generation_batch([job], None)[0]

    def run_generation_batch(self, jobs: list[np.ndarray], max_batch_tokens: int | None) -> list[dict[str, Any]]:
        waves = iter(self.decode_batch([j for j in jobs if len(j)], max_batch_tokens))
        return [{"audio": next(waves) if len(j) else np.zeros(0, np.float32), "sampling_rate": self.sampling_rate}
                for j in jobs]

    # -- streaming --------------------------------------------------------------
    def prepare_stream(self, inp: StageInput, seed: int) -> _CodeStream:
        state = _CodeStream()
        self._add(state, self._codes(inp))
        return state

    @staticmethod
    def _add(state: _CodeStream, frames: np.ndarray) -> None:
        if len(frames):
            state.frames.append(frames)
            state.total += len(frames)

    def extend_stream(self, state: _CodeStream, inp: StageInput, last: bool) -> None:
        if state.complete:
            raise RequestError("payload.codes: this request's frames are complete", field="payload.codes")
        self._add(state, self._codes(inp, state.total))
        state.complete = last  # with no frames at all: one empty last piece (no audio)

    def _next_end(self, state: _CodeStream) -> int | None:
        if state.last_cut:
            return None
        return self.schedule.next_end(state.windows, state.done, state.total, state.complete,
                                      self._right_context(state))

    def _right_context(self, state: _CodeStream) -> int:
        """The frames after a window it waits for: fewer for the first one (time to first audio) when set."""
        return self.first_right_context_frames if state.windows == 0 else self.right_context_frames

    def chunk_size(self, index: int) -> int:
        """Frames in a stream's chunk number `index` (stages/common/audio_chunks.py)."""
        return self.schedule.size(index)

    def stream_ready(self, state: _CodeStream) -> bool:
        return self._next_end(state) is not None

    # -- the engine's work items (pieces_span_steps): a window each ----------------
    def start_item(self, state: _CodeStream) -> _Window | None:
        end = self._next_end(state)
        if end is None:
            return None
        start = state.done
        if end <= start:
            return _Window(state, start, end, start, start, None, np.zeros(0, np.float32))
        lo = max(0, start - self.left_context_frames)
        hi = min(state.total, end + self._right_context(state))
        return _Window(state, start, end, lo, hi, state.codes(lo, hi))

    def item_size(self, item: _Window) -> int:
        return item.hi - item.lo

    def step_items(self, items: list[_Window]) -> None:
        waves = self.decode_batch([w.codes for w in items])
        for w, wave in zip(items, waves):  # only once every window decoded: a failure changes none
            w.audio = wave[(w.start - w.lo) * self.hop_length : (w.end - w.lo) * self.hop_length]

    def item_done(self, item: _Window) -> bool:
        return item.audio is not None

    def end_item(self, item: _Window) -> bool:
        state = item.stream
        state.done = item.end
        state.windows += 1
        state.last_cut = state.complete and item.end >= state.total
        return state.last_cut

    def finish_item(self, item: _Window) -> dict[str, Any]:
        return {"audio": item.audio, "sampling_rate": self.sampling_rate}
