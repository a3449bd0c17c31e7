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
                  left_context_codes (1 DiT block), lookahead_codes (1 DiT block), vocoder_thread (false),
                  dit_threads (1)

Batched (the engine's optional hooks `run_generation_batch` / `next_outputs`): the requests of one
engine step integrate the DiT's ODE in lockstep, packed along time (dit.py: each one's mel
is its mel alone), in calls of at most `max_batch_tokens` codes (the stage's
scheduler.max_num_batched_tokens; a longer one runs alone). BigVGAN then runs per window: batched over
windows of one length it is neither bitwise (oneDNN's convolutions block a batch differently) nor
faster on a CPU (measured on the small checkpoint: 4 mels of 148 frames, 1.2 s one by one, 2.3 s as one
batch).

Streamed windows run *continuously batched* (qwen2_5_omni_dit.ode_step): a window is admitted as soon
as its codes are there and its ODE advances one Runge-Kutta step per engine step, packed along time
with every other window in flight, each at its own step of its own ODE (their time modulations spread
over their frames); a window leaves through BigVGAN in the step its ODE ends. So windows of different
streams share the DiT's matrix products whenever they overlap, not only when they become ready in the
same step, and a newcomer never waits for whole windows: a stream's first window (short: the first
chunk and its look-ahead) runs to its end in one step of its own, ahead of the others (they resume
where they stopped), so its first audio waits one Runge-Kutta step of the windows in flight; the
windows held back then take their step before any further first window runs alone (newcomers slow
the streams already playing, never stop them). A
stream's windows still run one after another; the waveform is the windows' lockstep waveform up to
the blocking of fp32 sums (tested against the bound).

The vocoder thread (`vocoder_thread: true`): once a window's ODE ends, its stream's next window may start,
and BigVGAN turns the window's mel into samples on a thread of its own (one, FIFO: a stream's pieces leave
in order; pieces back together leave joined), while the stepping thread goes on with the DiT. A stream's
first window is still vocoded in the step its ODE ends (its time to first audio). BigVGAN was ~23% of the
stage's time at 4 streams, and the DiT steps are what bounds the stage's rate there. BigVGAN's ops are the
inline stage's on the same mel, and while every stream with work is in each step (no more than the
stage's max_num_seqs) the audio is bitwise the inline stage's (tested); with more, a stream's next window
may start before its piece is back and so step packed with other windows than inline, which is the DiT's
packing bound (a black-box pass measured 1.7e-10 to 3.8e-10 apart, 148-155 dB; tested against the bound).
The thread computes with the stepping thread's torch threads. A step with no window in flight waits for the thread at most VOCODER_POLL_S (no spinning,
and new codes are admitted soon); a failure there fails its stream alone; an aborted stream's pieces are
dropped when they come back.

Two DiT threads (`dit_threads: 2`): each Runge-Kutta step of several windows runs as two packs of about equal
frames (_halves), one of them on a second thread, joined before the step ends; ode_step touches only its
windows' ODE states, so the packs need no lock, and a pack that fails is stepped window by window in the
stepping thread (the one that fails alone fails its stream). A lone window is not split (a stream's first
window alone, concurrency 1). A window's values are its one-pack values up to the blocking of fp32 sums
(another packing: the bound of tests/stages). On the 2-core machine at 4 streams the DiT thread was the
stage's (and the pipeline's) bound while the machine was ~25% idle; `omni bench capacity --concurrency 1 4`
(one run each, README) at c4: 2.06 audio s/s inline (1.78x transformers in the same run), 2.21 and 1.89
with the vocoder thread (1.75x, 1.68x), 2.18 with both (2.12x, the machine 96% busy).

Measured on the random small checkpoint (150 codes): with >= 1 block of context on each side the
chunked waveform equals the one-shot one to fp32 rounding (SNR 122 dB); without look-ahead 19 dB,
without left context 24 dB. A trained DiT's attention reaches further through the ODE's steps:
measure the bound on real weights before trusting it there.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
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
from stages.qwen2_5_omni.dit import DiTRequest, ODEWindow, dit_sample_batch, ode_step, ode_window, time_grid
from stages.qwen2_5_omni.payloads import CodesToWave
from stages.qwen2_5_omni.talker import load_speakers, speaker_params
from stages.qwen2_5_omni.loading import load_omni_part

logger = logging.getLogger(__name__)

VOCODER_POLL_S = 0.02  # longest a step with nothing else to do waits for the vocoder thread


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
    finished: bool = False  # its last piece has been emitted
    pieces: list[np.ndarray] = field(default_factory=list)
    flight: _Flight | None = None  # its next window, in flight
    vocoding: int = 0  # its pieces at the vocoder thread, not yet back
    dropped: bool = False
    ready: tuple[dict[str, Any], bool] | Exception | None = None  # a finished piece (or failure) not yet taken


@dataclass(slots=True, eq=False)
class _Flight:
    """A stream's next chunk [start, end) of codes, its ODE in flight on the window [lo, hi)."""

    stream: _WavStream
    start: int
    end: int
    lo: int
    hi: int
    ode: ODEWindow
    first: bool  # the stream's first window: ahead of every other


@dataclass(slots=True, eq=False)
class _Vocoding:
    """A window's piece at the vocoder thread: its samples (or the exception) come back in `future`."""

    stream: _WavStream
    future: Future
    last: bool


class Qwen2_5OmniToken2WavStage(OneShotStageModel):
    checkpoint_prefix = "token2wav."
    streams_input = True
    pieces_span_steps = True
    tokenizer = None
    eos_token_id = None
    sampling_rate = 24000

    def __init__(self, token2wav, speakers: dict, device: torch.device, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, chunk_codes: int = 25,
                 first_chunk_codes: int = 10, left_context_codes: int | None = None,
                 lookahead_codes: int | None = None, max_chunk_codes: int | None = None,
                 vocoder_thread: bool = False, dit_threads: int = 1):
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
        self._flights: list[_Flight] = []  # windows in flight, in admission order
        self._times = time_grid(num_steps, sway_coefficient, self.dtype, device)  # every window's ODE times
        self._held = 0  # 1: the last step ran first windows while others waited (they go next)
        if not isinstance(vocoder_thread, bool):
            raise ValueError(f"model_kwargs.vocoder_thread: must be true or false, got {vocoder_thread!r}")
        self.vocoder_thread = vocoder_thread
        self._vocoder: ThreadPoolExecutor | None = None  # made on first use, in the stepping thread
        if isinstance(dit_threads, bool) or not isinstance(dit_threads, int) or dit_threads not in (1, 2):
            raise ValueError(f"model_kwargs.dit_threads: must be 1 or 2, got {dit_threads!r}")
        self.dit_threads = dit_threads
        self._dit_pool: ThreadPoolExecutor | None = None
        self._vocoding: deque[_Vocoding] = deque()  # pieces at the vocoder thread, in submission order
        self._vocoder_s = 0.0  # written by the vocoder thread only (one writer), read by stats()

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import Qwen2_5OmniToken2WavModel

        kwargs = dict(model_kwargs or {})
        gen = {k: kwargs.pop(k) for k in ("num_steps", "guidance_scale", "sway_coefficient", "chunk_codes",
                                          "first_chunk_codes", "max_chunk_codes", "left_context_codes",
                                          "lookahead_codes", "vocoder_thread", "dit_threads")
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
        return (state.ready is not None or state.flight is not None or state.vocoding > 0
                or self._next_end(state) is not None)

    def next_output(self, state: _WavStream) -> tuple[dict[str, Any] | None, bool]:
        result = self.next_outputs([state])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def next_outputs(self, states: list[_WavStream], max_batch_tokens: int | None = None
                     ) -> list[tuple[dict[str, Any] | None, bool] | Exception]:
        """One engine step: the given streams' next windows are admitted (those ready and not in flight),
        the windows in flight step (first windows to their end alone, else one Runge-Kutta step of all of
        them together: _step; at most `max_batch_tokens` codes, oldest first), those whose ODE ends go
        through BigVGAN, and each given stream gets its piece once its window is done: (None, False) while
        it is in flight, the exception when its window failed."""
        with torch.inference_mode():
            self._collect()
            for state in states:
                if state.flight is None and not isinstance(state.ready, Exception):
                    self._admit(state)
            if self._flights:
                self._step(max_batch_tokens)
            elif self._vocoding and all(state.ready is None for state in states):
                # Nothing to compute here but pieces at the vocoder: wait for the oldest a little (not
                # spinning the stepping loop), and no longer than a poll, so new codes are admitted soon.
                wait_futures([self._vocoding[0].future], timeout=VOCODER_POLL_S)
            self._collect()
        return [self._take(state) for state in states]

    def _admit(self, state: _WavStream) -> None:
        plan = self._plan(state)
        if plan is None:
            return
        start, end, lo, hi = plan
        if hi <= lo:  # everything was cut before the end was known: an empty last piece
            self._cut(state, end, lambda: np.zeros(0, np.float32), inline=state.vocoding == 0)
            return
        try:
            window = self._window(state.codes[lo:hi], state.speaker,
                                  state.noise[:, lo * self.repeats : hi * self.repeats])
            ode = ode_window(self.token2wav.code2wav_dit_model, window, self.kwargs["guidance_scale"])
        except Exception as exc:  # noqa: BLE001 - this stream fails, not the others
            self._fail(state, exc)
            return
        state.flight = _Flight(state, start, end, lo, hi, ode, first=state.windows == 0)
        self._flights.append(state.flight)

    def _step(self, max_tokens: int | None) -> None:
        first = [f for f in self._flights if f.first]
        others_wait = len(first) < len(self._flights)
        # First windows (short: first_chunk_codes + look-ahead) run to their end in one step of their own, so
        # a newcomer's first audio waits for one Runge-Kutta step of the windows in flight and is then not
        # cut into steps that other stages' steps interleave with (the local backend's one thread). The
        # windows held back take their step in the next one, whatever arrived meanwhile: newcomers slow
        # the streams already playing, never stop them.
        to_end = bool(first) and not (others_wait and self._held)
        self._held = int(to_end and others_wait)
        group: list[_Flight] = []
        size = 0
        for f in first if to_end else self._flights:
            if group and max_tokens is not None and size + (f.hi - f.lo) > max_tokens:
                break
            group.append(f)
            size += f.hi - f.lo
        while True:
            live = [f for f in group if f.stream.flight is f and not f.ode.done(self._times)]
            if not live:
                break
            self._ode_step(live)
            if not to_end:
                break
        for f in [f for f in group if f.stream.flight is f and f.ode.done(self._times)]:
            self._land(f, None)
            # A stream's first piece is vocoded here, now (its time to first audio); with the vocoder
            # thread, later ones go there and the DiT goes on with the windows in flight meanwhile.
            self._cut(f.stream, f.end, lambda f=f: self._vocode(f), inline=f.first or not self.vocoder_thread)

    def _vocode(self, f: _Flight) -> np.ndarray:
        """BigVGAN on a window's mel: the samples of its chunk [start, end)."""
        spf = self.samples_per_frame * self.repeats  # samples per codec token
        with torch.inference_mode():
            audio = self.token2wav.code2wav_bigvgan_model(f.ode.mel()).reshape(-1).float().cpu().numpy()
        return audio[(f.start - f.lo) * spf : (f.end - f.lo) * spf]

    def _ode_step(self, group: list[_Flight]) -> None:
        """One Runge-Kutta step of the group's windows together (with `dit_threads: 2`, in two packs of about
        equal frames, one on the DiT thread); a failure fails only the window that fails alone (each steps
        again by itself: ode_step changes no window unless it succeeds)."""
        packs = _halves(group) if self.dit_threads > 1 else [group]
        if len(packs) == 1:
            errors = [self._try_step(group)]
        else:
            other = self._pool("_dit_pool", "omni-dit").submit(self._try_step, packs[1])
            errors = [self._try_step(packs[0]), other.result()]
        for pack, exc in zip(packs, errors):
            if exc is None:
                continue
            if len(pack) == 1:
                self._land(pack[0], exc)
                continue
            logger.error("token2wav: a step of %d windows failed; stepping each alone", len(pack), exc_info=exc)
            for f in pack:
                alone = self._try_step([f])
                if alone is not None:
                    self._land(f, alone)

    def _try_step(self, pack: list[_Flight]) -> Exception | None:
        """ode_step on the pack's windows (in any thread: it touches only their ODE states), or its exception."""
        try:
            with torch.inference_mode():
                ode_step(self.token2wav.code2wav_dit_model, [f.ode for f in pack], self._times,
                         self.kwargs["guidance_scale"])
        except Exception as exc:  # noqa: BLE001 - the caller fails the windows, in the stepping thread
            return exc
        return None

    def _land(self, flight: _Flight, error: Exception | None) -> None:
        """A window leaves the flights (done, or failed with `error`: its stream fails)."""
        if flight in self._flights:
            self._flights.remove(flight)
        if flight.stream.flight is flight:
            flight.stream.flight = None
            if error is not None:
                self._fail(flight.stream, error)

    def _cut(self, state: _WavStream, end: int, piece: Callable[[], np.ndarray], inline: bool) -> None:
        """A window's ODE has ended (or an empty last piece): its codes up to `end` are cut, so the stream's
        next window can start, and its samples (`piece()`) are made here (`inline`) or queued for the
        vocoder thread behind the stream's pieces already there (a stream's pieces leave in order)."""
        state.done = end
        state.windows += 1
        last = state.complete and end >= len(state.codes)
        state.last_cut = last
        if inline and state.vocoding == 0:
            try:
                samples = piece()
            except Exception as exc:  # noqa: BLE001 - this stream fails, not the others
                self._fail(state, exc)
                return
            self._deliver(state, samples, last)
            return
        state.vocoding += 1
        future = self._pool("_vocoder", "omni-vocoder").submit(self._timed, piece)
        self._vocoding.append(_Vocoding(state, future, last))

    def _timed(self, piece: Callable[[], np.ndarray]) -> np.ndarray:
        t = time.perf_counter()
        try:
            return piece()
        finally:
            self._vocoder_s += time.perf_counter() - t

    def _pool(self, attr: str, name: str) -> ThreadPoolExecutor:
        """A one-thread pool of this stage's (made on first use, in the stepping thread)."""
        if getattr(self, attr) is None:
            # torch's thread count is per thread (omni/pipeline/threads.py): the pool computes with the
            # stepping thread's count, the cores this stage was given.
            setattr(self, attr, ThreadPoolExecutor(1, thread_name_prefix=name, initializer=torch.set_num_threads,
                                                   initargs=(torch.get_num_threads(),)))
        return getattr(self, attr)

    def _collect(self) -> None:
        """Pieces back from the vocoder thread go to their streams, in submission order."""
        while self._vocoding and self._vocoding[0].future.done():
            v = self._vocoding.popleft()
            v.stream.vocoding -= 1
            exc = v.future.exception()
            if exc is not None:
                self._fail(v.stream, exc)
            else:
                self._deliver(v.stream, v.future.result(), v.last)

    def _deliver(self, state: _WavStream, piece: np.ndarray, last: bool) -> None:
        """A piece for the engine to take; one it has not taken yet leaves with it, joined (in order)."""
        if state.dropped or isinstance(state.ready, Exception):
            return
        state.pieces.append(piece)
        state.finished = last
        if state.ready is not None:
            piece = np.concatenate([state.ready[0]["audio"], piece])
        state.ready = ({"audio": piece, "sampling_rate": self.sampling_rate}, last)

    def _fail(self, state: _WavStream, error: Exception) -> None:
        """The stream fails with `error` (its window in flight stops; its pieces at the vocoder are ignored)."""
        if state.flight is not None:
            self._land(state.flight, None)
        state.dropped = True
        state.ready = error

    @staticmethod
    def _take(state: _WavStream) -> tuple[dict[str, Any] | None, bool] | Exception:
        result, state.ready = state.ready, None
        return (None, False) if result is None else result

    def drop_stream(self, state: _WavStream) -> None:
        """An aborted stream: its window in flight goes (the others keep their steps)."""
        if state.flight is not None:
            self._land(state.flight, None)
        state.dropped = True
        state.ready = None

    def close(self) -> None:
        """The stage's threads go (a later stream makes new ones)."""
        for attr in ("_vocoder", "_dit_pool"):
            pool = getattr(self, attr)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                setattr(self, attr, None)
        self._vocoding.clear()

    def stats(self) -> dict[str, Any]:
        # seconds BigVGAN ran on the vocoder thread (outside the engine's steps)
        return {"vocoder_time_s": self._vocoder_s} if self.vocoder_thread else {}

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

    def stream_result(self, state: _WavStream) -> dict[str, Any]:
        """The whole waveform of a finished stream: its pieces, concatenated."""
        audio = np.concatenate(state.pieces) if state.pieces else np.zeros(0, np.float32)
        return {"audio": audio.astype(np.float32), "sampling_rate": self.sampling_rate}


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


def _halves(group: list[_Flight]) -> list[list[_Flight]]:
    """The group in two packs of about equal frames (largest window first into the lighter pack; each pack
    in the group's order), or one pack of a lone window."""
    if len(group) < 2:
        return [group]
    packs: list[list[int]] = [[], []]
    load = [0, 0]
    for i in sorted(range(len(group)), key=lambda i: -(group[i].hi - group[i].lo)):
        k = 0 if load[0] <= load[1] else 1
        packs[k].append(i)
        load[k] += group[i].hi - group[i].lo
    return [[group[i] for i in sorted(p)] for p in packs]
