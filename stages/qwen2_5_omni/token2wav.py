"""Qwen2.5-Omni token2wav as a (non-autoregressive) stage: codec tokens -> waveform.

A DiT turns the codec tokens into a mel spectrogram by integrating an ODE from Gaussian noise
(10 Runge-Kutta steps, classifier-free guidance), and BigVGAN turns the mel into a 24 kHz
waveform. No KV cache and no prefix caching: it runs in omni.engine.one_shot.

The noise comes from torch's global RNG (transformers' code draws it with `torch.randn`), so each
request runs under `torch.random.fork_rng` seeded with the request's seed (sampling `seed`, else 0):
the same codes and seed give the same waveform, whatever else ran before.

Streaming (a `stream: true` edge from the talker): codec tokens arrive in chunks and the waveform
leaves in chunks. The DiT's attention is block-local (blocks of `block_size` mel frames, one
block of look-ahead / look-back in a few layers), so a chunk of codes [a, b) is generated on a
window [a - left_context, b + lookahead), aligned to DiT blocks, and only its own frames are kept;
BigVGAN runs on the window's mel and the chunk's samples are cut out. The ODE starts from the same
noise the one-shot path draws for those frames (one seeded draw per request, sliced), so a request
that fits in one chunk gives exactly the one-shot waveform and longer ones differ only by the
context each window lacks (measured in tests: max |diff| and SNR). Chunk sizes follow the common
schedule (stages/common/audio_chunks.py): `first_chunk_codes`, then `chunk_codes` doubling up to
`max_chunk_codes` (default: `chunk_codes`, a fixed size), a short last chunk on its own. Each window
computes its chunk plus its context again (one block each side), so longer later chunks spend less of
the DiT on context, while the first audio comes as soon.

    model_kwargs: chunk_codes (25), first_chunk_codes (10), max_chunk_codes (chunk_codes),
                  left_context_codes (1 DiT block), lookahead_codes (1 DiT block); the engine's worker
                  threads go here too, under their YAML names: vocoder_thread (false: the engine's
                  finish_thread, BigVGAN) and dit_threads (1: its compute_threads, DiT packs)

Batched (the engine's optional hook `run_generation_batch`): the requests of one engine step integrate
the DiT's ODE in lockstep, packed along time (dit.py: each one's mel is its mel alone), in calls of at
most `max_batch_tokens` codes (the stage's scheduler.max_num_batched_tokens; a longer one runs alone).
BigVGAN then runs per window: batched over windows of one length it is not bitwise (oneDNN's
convolutions block a batch differently), and not faster on a CPU.

Streamed windows are the engine's work items (`pieces_span_steps`: omni/engine/in_flight.py batches them
continuously across streams and steps, and runs its threads): a window starts as soon as its codes are
there (start_item), its ODE advances one Runge-Kutta step per engine step packed along time with every
other window in flight, each at its own step of its own ODE (step_items: dit.ode_step, their time
modulations spread over their frames), and BigVGAN turns its mel into its chunk's samples once its ODE
ends (finish_item). A stream's windows run one after another; the waveform is the windows' lockstep
waveform up to the blocking of fp32 sums (tested against the bound). BigVGAN's ops are the same on the
engine's finish thread, so with it the audio is bitwise the inline stage's while every stream with work is
in each step, and within the DiT's packing bound otherwise (tested); the same holds for two DiT packs.

With >= 1 block of context on each side the chunked waveform equals the one-shot one to fp32 rounding;
without look-ahead or without left context it is far off (tests/stages measure both). A trained DiT's
attention reaches further through the ODE's steps: measure the bound on real weights before trusting it
there.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni.engine.stage_model import OneShotStageModel
from omni.errors import RequestError
from omni.messages import StageInput

from stages.common.audio_chunks import ChunkSchedule
from stages.common.processors import expect_payload
from stages.qwen2_5_omni.dit import DiTRequest, ODEWindow, dit_sample_batch, ode_step, ode_window, time_grid
from stages.qwen2_5_omni.payloads import CodesToWave
from stages.qwen2_5_omni.info import TOKEN2WAV
from stages.qwen2_5_omni.talker import load_speakers, speaker_params
from stages.qwen2_5_omni.loading import load_omni_part


@dataclass(slots=True, eq=False)
class _WavStream:
    """One request whose codes arrive in chunks."""

    codes: list[int]
    speaker: str | None
    noise: torch.Tensor  # [1, max_frames, mel_dim]: the one-shot path's draw for this seed
    done: int = 0  # codes whose window's ODE has ended (their audio emitted, or at the vocoder)
    windows: int = 0  # windows whose ODE has ended (the next chunk's size follows from it)
    last_cut: bool = False  # the window ending the request has been cut: no further window
    complete: bool = False


@dataclass(slots=True, eq=False)
class _Window:
    """A stream's next chunk [start, end) of codes (the engine's work item), its ODE on the window [lo, hi)
    (None: an empty last piece)."""

    stream: _WavStream
    start: int
    end: int
    lo: int
    hi: int
    ode: ODEWindow | None


class Qwen2_5OmniToken2WavStage(OneShotStageModel):
    checkpoint_prefix = "token2wav."
    info = TOKEN2WAV
    pieces_span_steps = True
    tokenizer = None
    eos_token_id = None
    sampling_rate = 24000

    def __init__(self, token2wav, speakers: dict, device: torch.device, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, chunk_codes: int = 25,
                 first_chunk_codes: int = 10, left_context_codes: int | None = None,
                 lookahead_codes: int | None = None, max_chunk_codes: int | None = None):
        self.token2wav = token2wav
        self.speakers = speakers
        self.device = device
        self.dtype = torch.float32  # transformers runs token2wav in fp32 only
        dit = token2wav.config.dit_config
        self.num_codes = dit.num_embeds
        self.max_codes = dit.max_position_embeddings // dit.repeats
        self.vocab_size = dit.num_embeds
        self.hidden_size = dit.hidden_size
        self.max_model_len = self.max_codes
        self.kwargs = {"num_steps": num_steps, "guidance_scale": guidance_scale,
                       "sway_coefficient": sway_coefficient}
        self.repeats = dit.repeats
        self.mel_dim = dit.mel_dim
        block = max(1, dit.block_size // dit.repeats)  # codes per DiT attention block
        self.block_codes = block
        self.schedule = ChunkSchedule.from_kwargs("codes", chunk_codes, first_chunk_codes, max_chunk_codes)
        self.left_context_codes = block if left_context_codes is None else int(left_context_codes)
        self.lookahead_codes = block if lookahead_codes is None else int(lookahead_codes)
        for name in ("left_context_codes", "lookahead_codes"):
            if getattr(self, name) < 0:
                raise ValueError(f"model_kwargs.{name}: must be >= 0, got {getattr(self, name)}")
        bigvgan = token2wav.config.bigvgan_config
        self.samples_per_frame = int(np.prod(bigvgan.upsample_rates))
        self._times = time_grid(num_steps, sway_coefficient, self.dtype, device)  # every window's ODE times

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import Qwen2_5OmniToken2WavModel

        kwargs = dict(model_kwargs or {})
        gen = {k: kwargs.pop(k) for k in ("num_steps", "guidance_scale", "sway_coefficient", "chunk_codes",
                                          "first_chunk_codes", "max_chunk_codes", "left_context_codes",
                                          "lookahead_codes")
               if k in kwargs}
        model, _ = load_omni_part(Path(model_path), "token2wav", Qwen2_5OmniToken2WavModel, torch.float32,
                                  device, **kwargs)
        return cls(model, load_speakers(Path(model_path)), device, **gen)

    def codes_of(self, inp: StageInput) -> list[int]:
        codes = [int(t) for t in (inp.prompt_token_ids or [])]  # none: no audio (a talker's eos came first)
        bad = [c for c in codes if not 0 <= c < self.num_codes]
        if bad:
            raise RequestError(f"prompt_token_ids: codec token {bad[0]} is out of range (0..{self.num_codes - 1})",
                               field="prompt_token_ids", limit=self.num_codes, actual=bad[0])
        if len(codes) > self.max_codes:
            raise RequestError(f"prompt_token_ids: {len(codes)} codec tokens, at most {self.max_codes} allowed",
                               field="prompt_token_ids")
        return codes

    def speaker_inputs(self, speaker: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A speaker's conditioning vector [1, D] and reference mel [1, frames, mel], as token2wav takes them."""
        spk = speaker_params(self.speakers, speaker)
        return (spk["cond"].to(self.device).float().expand(1, -1),
                spk["ref_mel"].to(self.device).float().expand(1, -1, -1))

    def _noise(self, seed: int, codes: int) -> torch.Tensor:
        """transformers' draw in `dit.sample` for `codes` codes under `seed` (same shape, dtype, device
        and RNG state): [1, codes * repeats, mel]. A prefix of a seeded draw is the shorter draw."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return torch.randn([1, codes * self.repeats, self.mel_dim], dtype=self.dtype, device=self.device)

    def _window(self, codes: list[int], speaker: str | None, noise: torch.Tensor) -> DiTRequest:
        cond, ref = self.speaker_inputs(speaker)
        return DiTRequest(cond, ref, torch.tensor([codes], dtype=torch.long, device=self.device), noise)

    @torch.inference_mode()
    def _audio(self, windows: list[DiTRequest], max_batch_tokens: int | None = None) -> list[np.ndarray]:
        """The waveform of each window: the DiT in lockstep over calls of at most `max_batch_tokens`
        codes (in order; a longer window alone), then BigVGAN per window."""
        dit, bigvgan = self.token2wav.code2wav_dit_model, self.token2wav.code2wav_bigvgan_model
        mels: list[torch.Tensor] = []
        for batch in _batches(windows, max_batch_tokens):
            mels += dit_sample_batch(dit, batch, **self.kwargs)
        return [bigvgan(mel).reshape(-1).float().cpu().numpy() for mel in mels]

    def generate(self, codes: list[int], speaker: str | None = None, seed: int = 0) -> np.ndarray:
        """Codec tokens -> float32 waveform [num_samples] (transformers' DiT sampler with the request's
        constants computed once: bitwise the same mel)."""
        (audio,) = self._audio([self._window(codes, speaker, self._noise(seed, len(codes)))])
        return audio

    # -- OneShotStageEngine hooks ---------------------------------------------
    def prepare_generation(self, inp: StageInput, seed: int) -> tuple[list[int], str | None, int]:
        speaker = _speaker(inp)
        speaker_params(self.speakers, speaker)  # unknown speaker: ValueError at add time
        return self.codes_of(inp), speaker, seed

    def run_generation(self, job: tuple[list[int], str | None, int]) -> dict[str, Any]:
        codes, speaker, seed = job
        audio = self.generate(codes, speaker, seed) if codes else np.zeros(0, np.float32)
        return {"audio": audio, "sampling_rate": self.sampling_rate}

    def run_generation_batch(self, jobs: list[tuple[list[int], str | None, int]],
                             max_batch_tokens: int) -> list[dict[str, Any]]:
        windows = [self._window(codes, speaker, self._noise(seed, len(codes))) for codes, speaker, seed in jobs
                   if codes]
        audios = iter(self._audio(windows, max_batch_tokens))
        return [{"audio": next(audios) if codes else np.zeros(0, np.float32), "sampling_rate": self.sampling_rate}
                for codes, _, _ in jobs]

    # -- streaming --------------------------------------------------------------
    def prepare_stream(self, inp: StageInput, seed: int) -> _WavStream:
        speaker = _speaker(inp)
        speaker_params(self.speakers, speaker)
        codes = self._check_codes([int(t) for t in (inp.prompt_token_ids or [])], 0)
        # The one-shot path's draw for the longest possible request: each window slices its frames.
        return _WavStream(codes, speaker, self._noise(seed, self.max_codes))

    def _check_codes(self, codes: list[int], have: int) -> list[int]:
        bad = [c for c in codes if not 0 <= c < self.num_codes]
        if bad:
            raise RequestError(f"prompt_token_ids: codec token {bad[0]} is out of range (0..{self.num_codes - 1})",
                               field="prompt_token_ids", limit=self.num_codes, actual=bad[0])
        if have + len(codes) > self.max_codes:
            raise RequestError(f"prompt_token_ids: {have + len(codes)} codec tokens, at most {self.max_codes} allowed",
                               field="prompt_token_ids")
        return codes

    def extend_stream(self, state: _WavStream, inp: StageInput, last: bool) -> None:
        if state.complete:
            raise RequestError("prompt_token_ids: this request's codes are complete", field="prompt_token_ids")
        state.codes += self._check_codes([int(t) for t in (inp.prompt_token_ids or [])], len(state.codes))
        state.complete = last  # with no codes at all: one empty last piece (no audio)

    def _next_end(self, state: _WavStream) -> int | None:
        """End (exclusive) of the next chunk of codes, or None while it cannot be made yet."""
        if state.last_cut:
            return None
        return self.schedule.next_end(state.windows, state.done, len(state.codes), state.complete,
                                      self.lookahead_codes)

    def chunk_size(self, index: int) -> int:
        """Codes in a stream's chunk number `index` (stages/common/audio_chunks.py)."""
        return self.schedule.size(index)

    def stream_ready(self, state: _WavStream) -> bool:
        return self._next_end(state) is not None

    # -- the engine's work items (pieces_span_steps): a window each ----------------
    def start_item(self, state: _WavStream) -> _Window | None:
        plan = self._plan(state)
        if plan is None:
            return None
        start, end, lo, hi = plan
        if hi <= lo:  # everything was cut before the end was known: an empty last piece
            return _Window(state, start, end, lo, hi, None)
        window = self._window(state.codes[lo:hi], state.speaker, state.noise[:, lo * self.repeats : hi * self.repeats])
        return _Window(state, start, end, lo, hi,
                       ode_window(self.token2wav.code2wav_dit_model, window, self.kwargs["guidance_scale"]))

    def item_size(self, item: _Window) -> int:
        return item.hi - item.lo

    def step_items(self, items: list[_Window]) -> None:
        ode_step(self.token2wav.code2wav_dit_model, [w.ode for w in items], self._times, self.kwargs["guidance_scale"])

    def item_done(self, item: _Window) -> bool:
        return item.ode is None or item.ode.done(self._times)

    def end_item(self, item: _Window) -> bool:
        """The window's codes up to its end are cut: the stream's next window may start."""
        state = item.stream
        state.done = item.end
        state.windows += 1
        state.last_cut = state.complete and item.end >= len(state.codes)
        return state.last_cut

    def finish_item(self, item: _Window) -> dict[str, Any]:
        """BigVGAN on a window's mel: the samples of its chunk [start, end)."""
        if item.ode is None:
            return {"audio": np.zeros(0, np.float32), "sampling_rate": self.sampling_rate}
        spf = self.samples_per_frame * self.repeats  # samples per codec token
        with torch.inference_mode():
            audio = self.token2wav.code2wav_bigvgan_model(item.ode.mel()).reshape(-1).float().cpu().numpy()
        return {"audio": audio[(item.start - item.lo) * spf : (item.end - item.lo) * spf],
                "sampling_rate": self.sampling_rate}

    def _plan(self, state: _WavStream) -> tuple[int, int, int, int] | None:
        """(start, end) of the stream's next chunk of codes and (lo, hi) of the window computed for it
        (lo == hi: an empty piece), or None while nothing is ready."""
        end = self._next_end(state)
        if end is None:
            return None
        start, total = state.done, len(state.codes)
        if end <= start:
            return start, end, start, start
        # The window: left context aligned down to a DiT block (the block partition then matches
        # the whole sequence's), the chunk, and the look-ahead its last frames attend to.
        lo = max(0, start - self.left_context_codes) // self.block_codes * self.block_codes
        hi = min(total, end + self.lookahead_codes)
        return start, end, lo, hi


def _speaker(inp: StageInput) -> str | None:
    """The speaker talker2wav hands on (no payload: the default speaker)."""
    return None if inp.payload is None else expect_payload(inp, CodesToWave, "talker2wav").speaker


def _batches(windows: list[DiTRequest], max_tokens: int | None) -> list[list[DiTRequest]]:
    """Consecutive windows in calls of at most `max_tokens` codes (None: one call); a window longer
    than that runs alone."""
    batches: list[list[DiTRequest]] = []
    size = 0
    for w in windows:
        n = w.code.shape[1]
        if batches and (max_tokens is None or size + n <= max_tokens):
            batches[-1].append(w)
            size += n
        else:
            batches.append([w])
            size = n
    return batches
