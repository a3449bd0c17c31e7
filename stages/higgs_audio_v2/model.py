"""Higgs Audio v2's LLM as a stage: text (and reference voices) in, audio codec frames out, one frame a step.

Mirrors transformers' `HiggsAudioV2ForConditionalGeneration.generate` for one request:

    prompt        the conversation rendered by the checkpoint's chat template, each audio item's placeholders
                  expanded to its frames (stages/higgs_audio_v2/prompt.py); an audio position's input is the sum
                  of its frame's K codebook embeddings (`embed_audio_tokens`), a text position's the token's
    decoder       the Llama decoder with DualFFN: a position whose token is <|AUDIO_OUT|> or the delay token
                  goes through the audio layer norms and MLP, any other through the text ones (transformers
                  runs every decode position on the audio path: each is one of those two tokens)
    a step        the audio head's K x C logits of the request's last position, masked by the delay pattern
                  (stages/higgs_audio_v2/delay.py), sampled per codebook with the request's temperature, top-k
                  and top-p (greedy: argmax); the frame feeds the next position; the token the engine appends
                  is the frame's flat token (audio / delay / eos: eos ends the request)

The frame is sampled inside `forward`, which knows each row's request; `compute_logits` then hands the engine
logits that allow only the frame's flat token, so the engine's stop rules (eos, max_tokens) run as for any model.
Log-probabilities and the sampler's token-level options mean nothing here and are refused at admission;
`min_tokens` is the frames before which no codebook may end (stream-eos masked, as a text model's eos is).

Per-token output `audio_codes`: at the position that sampled frame j, the frame (K codes); -1 elsewhere, so the
codec edge reads every frame, the last one included, from the rows.

Block hashes: the prompt's audio items are multimodal features hashed by their frames (any code of any codebook
changes the hash), so two prompts that differ in one residual code never share a block. Generated positions are
hashed by their flat tokens: under greedy decoding a frame is a function of the prefix, so equal hashes mean equal
frames. A request recomputed after preemption replays its own kept frames, but its generated blocks are looked up
by flat tokens: a *sampled* request preempted while another sampled request with the same prompt holds generated
blocks of the same flat tokens could take their KV (not its own frames'). Only the engine's preemption reaches this
(size the KV cache so it never preempts, or give such requests a `cache_salt`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni.engine.memory import StageGeometry, checkpoint_geometry
from omni.engine.runner.attention import register_attention
from omni.engine.runner.output_head import prepare_cpu_head
from omni.engine.runner.forward_context import get_forward_context
from omni.engine.runner.sampler import Sampler, make_generator
from omni.engine.stage_model import AutoregressiveStageModel, KVSpec, PreparedPrompt
from omni.errors import RequestError
from omni.messages import EdgePayload, StageInput
from omni.sampling_params import SamplingParams

from stages.common.decoder import decoder_kv_spec
from stages.higgs_audio_v2.delay import AudioIds, DelayState, next_token
from stages.higgs_audio_v2.info import MODEL
from stages.higgs_audio_v2.payloads import SpeakNext
from stages.higgs_audio_v2.prompt import HiggsPrompter

logger = logging.getLogger(__name__)
MIN_TURN_FRAMES = 25  # a second of audio

# Request options that select or score text tokens: the frames are sampled by the stage, not by the engine.
_REFUSED = {"logprobs": None, "prompt_logprobs": None, "ignore_eos": False}


@dataclass(slots=True)
class _Request:
    num_prompt: int
    frames_at: dict[int, np.ndarray]  # prompt position -> its audio frame [K]
    ids: list[int]  # the request's tokens as the engine holds them: prompt, flat tokens, later turns
    params: SamplingParams
    generator: torch.Generator | None
    input_complete: bool = True
    sampled: dict[int, list[int]] = field(default_factory=dict)  # position -> the frame sampled there (next input)
    speaking: bool = True  # a turn's audio is being generated (False: its last frame came, the next turn has not)
    pending: list[str] = field(default_factory=list)  # text to speak after the current turn
    turn_ids: list[int] = field(default_factory=list)  # rendered, not yet taken by the engine
    delay: DelayState | None = None
    turn_cap: int | None = None  # the current turn's codebook 0 ends at this frame (model_kwargs.turn_frames_per_char)
    turn_frames: int = 0
    min_frames: int = 0  # min_tokens: no codebook may end before this many frames were sampled


class HiggsAudioV2Stage(AutoregressiveStageModel):
    info = MODEL

    def __init__(self, model, tokenizer, prompter: HiggsPrompter, device: torch.device, dtype: torch.dtype,
                 turn_frames_per_char: float | None = None):
        self.model = model
        # A turn's frames are bounded by its text (model_kwargs.turn_frames_per_char): codebook 0 is made to end at
        # frame max(MIN_TURN_FRAMES, ceil(per_char x characters)) and the delay pattern ends the others K - 1 frames
        # later, as a chunk of Higgs' long-form generation is bounded by its max_new_tokens. None: only max_tokens.
        self.turn_frames_per_char = turn_frames_per_char
        self.tokenizer = tokenizer
        self.prompter = prompter
        self.device, self.dtype = device, dtype
        cfg = self.config = model.config
        self.info = prompter.info(MODEL)
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_model_len = int(cfg.max_position_embeddings)
        self.eos_token_id = int(cfg.eos_token_id if not isinstance(cfg.eos_token_id, list) else cfg.eos_token_id[0])
        self.ids = AudioIds(audio_token=cfg.audio_token_id, delay_token=cfg.audio_delay_token_id,
                            audio_bos=cfg.audio_bos_token_id, eos_token=self.eos_token_id,
                            stream_bos=cfg.audio_stream_bos_id, stream_eos=cfg.audio_stream_eos_id,
                            num_codebooks=cfg.num_codebooks, codebook_size=cfg.codebook_size)
        self.decoder = model.model
        self.sampler = Sampler()
        self._requests: dict[str, _Request] = {}
        self._flat: list[int] = []  # flat tokens of this step's sampled rows, in packed order

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None) -> "HiggsAudioV2Stage":
        from transformers import AutoTokenizer, HiggsAudioV2ForConditionalGeneration

        kwargs = dict(model_kwargs or {})
        per_char = kwargs.pop("turn_frames_per_char", None)
        if per_char is not None and not (isinstance(per_char, (int, float)) and per_char > 0):
            raise ValueError(f"model_kwargs.turn_frames_per_char: a number > 0 (frames a character), got {per_char!r}")
        model = HiggsAudioV2ForConditionalGeneration.from_pretrained(
            str(model_path), dtype=dtype, attn_implementation=register_attention())
        model.to(device).eval()
        # transformers' own products in the decoder (no pack_cpu_linears): packed, a near-tied code of a long reply
        # flips against transformers' generate (as for the omni stages; omni/engine/runner/cpu_linear.py)
        prepare_cpu_head(model.audio_lm_head, device)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        prompter = HiggsPrompter.from_checkpoint(Path(model_path), tokenizer, model.config, device, kwargs)
        return cls(model, tokenizer, prompter, device, dtype, per_char)

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> StageGeometry | None:
        return checkpoint_geometry(model_path)

    def kv_spec(self) -> KVSpec:
        return decoder_kv_spec(self.config)

    def stats(self) -> dict[str, Any]:
        return self.prompter.stats()

    # -- requests -------------------------------------------------------------------------------
    def preprocess(self, inp: StageInput) -> PreparedPrompt:
        sp = inp.sampling_params
        if isinstance(sp, SamplingParams):
            for name, default in _REFUSED.items():
                value = getattr(sp, name, default)
                if value is not None and value != default:
                    raise RequestError(f"{name}: higgs_audio_v2 samples audio frames, not text tokens: leave "
                                       f"{name} at {default!r}", field=name)
        return self.prompter.prepare(inp)

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: StageInput) -> None:
        if prompt is None:
            raise RequestError("higgs_audio_v2 renders its own prompt: give text or chat messages", field="prompt")
        sp = inp.sampling_params if isinstance(inp.sampling_params, SamplingParams) else SamplingParams()
        params = SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                                seed=sp.seed)
        self._requests[request_id] = _Request(
            num_prompt=len(prompt.token_ids), frames_at=prompt.extra["frames_at"], ids=list(prompt.token_ids),
            params=params, generator=make_generator(params, self.device), input_complete=inp.input_complete,
            turn_cap=self._turn_cap(prompt.extra.get("turn_chars", 0)), min_frames=sp.min_tokens)
        if inp.payload is not None:
            self.extend_request(request_id, inp.payload, inp.input_complete)

    def extend_request(self, request_id: str, payload: EdgePayload | None, last: bool) -> None:
        """The next piece of text to speak (SpeakNext), spoken once the current turn's audio has ended."""
        st = self._requests[request_id]
        if payload is not None:
            if not isinstance(payload, SpeakNext):
                raise RequestError(f"payload: higgs_audio_v2 takes text to speak next (SpeakNext), not "
                                   f"{type(payload).__name__}", field="payload")
            if payload.text.strip():
                st.pending.append(payload.text)
        st.input_complete = st.input_complete or last
        self._next_turn(st)

    def _next_turn(self, st: _Request) -> None:
        """After a turn's last frame: render the next piece as the next turn (when it fits the context)."""
        if st.speaking or not st.pending:
            return
        text = " ".join(p.strip() for p in st.pending)
        st.pending.clear()
        turn = self.prompter.next_turn(text)
        if len(st.ids) + len(turn) >= self.max_model_len:  # no room left to speak it: the reply ends here
            logger.warning("higgs_audio_v2: %d more tokens do not fit max_model_len %d: the rest of the reply is "
                           "not spoken", len(turn), self.max_model_len)
            st.input_complete = True
            return
        st.ids.extend(turn)
        st.turn_ids.extend(turn)
        st.speaking, st.delay = True, None
        st.turn_cap, st.turn_frames = self._turn_cap(len(text.strip())), 0

    def _turn_cap(self, chars: int) -> int | None:
        if self.turn_frames_per_char is None:
            return None
        return max(MIN_TURN_FRAMES, math.ceil(self.turn_frames_per_char * chars))

    def take_input(self) -> dict[str, list[int]]:
        out = {}
        for rid, st in self._requests.items():
            if st.turn_ids:
                out[rid], st.turn_ids = st.turn_ids, []
        return out

    def compute_limit(self, request_id: str) -> int | None:
        """A turn's last frame waits (uncomputed) for the next turn's text, or the end of the input."""
        st = self._requests.get(request_id)
        if st is None or st.speaking or st.input_complete:
            return None
        return len(st.ids) - 1

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # -- the step -------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def _frame_rows(self, ctx) -> tuple[list[int], list[list[int]]]:
        """The batch rows that are audio positions with a known frame, and their frames."""
        rows, frames = [], []
        for rid, a, start, end in ctx.request_spans():
            st = self._requests[rid]
            for p in range(start, end):
                frame = st.frames_at.get(p) if p < st.num_prompt else st.sampled.get(p - 1)
                if frame is not None:
                    rows.append(a + p - start)
                    frames.append(frame if isinstance(frame, list) else frame.tolist())
        return rows, frames

    def forward(self, input_ids, inputs_embeds, positions) -> dict[str, torch.Tensor]:
        ctx = get_forward_context()
        ids = input_ids
        embeds = self.decoder.embed_tokens(ids) if inputs_embeds is None else inputs_embeds.clone()
        rows, frames = self._frame_rows(ctx)
        audio = (ids == self.ids.audio_token) | (ids == self.ids.delay_token)
        if rows:
            codes = torch.tensor(frames, dtype=torch.long, device=embeds.device)
            audio_embeds = self.decoder.embed_audio_tokens(codes)
            embeds[torch.tensor(rows, device=embeds.device)] = audio_embeds.to(embeds.dtype)
        mask = None if bool(audio.all()) else audio[None]
        h = embeds[None]
        pos = positions[None]
        rotary = self.decoder.rotary_emb(h, pos)
        for layer in self.decoder.layers[: self.config.num_hidden_layers]:
            h = layer(h, position_embeddings=rotary, attention_mask=None, audio_token_mask=mask, position_ids=pos)
        hidden = self.decoder.norm(h)[0]
        out_codes = torch.full((hidden.shape[0], self.ids.num_codebooks), -1.0, dtype=torch.float32,
                               device=hidden.device)
        self._flat = self._sample_frames(ctx, hidden)
        self._codes_rows(ctx, out_codes)
        return {"hidden_states": hidden, "audio_codes": out_codes}

    def _sample_frames(self, ctx, hidden: torch.Tensor) -> list[int]:
        """Sample the frame of every request whose last known position this step computed (a request whose turn
        ended and whose input is complete gets the eos token instead: its reply ends there)."""
        due: list[tuple[_Request, int, int]] = []  # (request, batch row, position)
        ended: dict[int, int] = {}  # index among the due rows -> the token without a frame
        for rid, a, start, end in ctx.request_spans():
            st = self._requests[rid]
            if end == len(st.ids) and end >= st.num_prompt:
                if not st.speaking:
                    ended[len(due)] = self.ids.eos_token
                due.append((st, a + end - 1 - start, end - 1))
        if not due:
            return []
        speaking = [i for i in range(len(due)) if i not in ended]
        k, c = self.ids.num_codebooks, self.ids.codebook_size
        codes: list[list[int]] = []
        if speaking:
            rows = torch.tensor([due[i][1] for i in speaking], device=hidden.device)
            logits = self.model.audio_lm_head(hidden[rows]).float().view(len(speaking), k, c)
            masked = []
            for i, scores in zip(speaking, logits):
                st, _, p = due[i]
                if st.delay is None:
                    st.delay = DelayState(self.ids, st.ids[p + 1 - k:p + 1])
                scores = st.delay.mask(scores, st.ids[p])
                if len(st.sampled) < st.min_frames:  # min_tokens: no codebook ends yet (any one's stream-eos
                    free = torch.isfinite(scores).sum(dim=1) > 1  # would start the end), unless forced
                    scores[free, self.ids.stream_eos] = float("-inf")
                if st.turn_cap is not None and st.turn_frames >= st.turn_cap:
                    scores[0, :] = float("-inf")  # the turn is as long as its text allows: codebook 0 ends,
                    scores[0, self.ids.stream_eos] = 0.0  # the delay pattern ends the others after it
                masked.append(scores)
            params = [due[i][0].params for i in speaking for _ in range(k)]
            gens = [due[i][0].generator for i in speaking for _ in range(k)]
            codes = self.sampler(torch.cat(masked), params, gens).view(len(speaking), k).tolist()
        flat, it = [], iter(codes)
        for i, (st, _, p) in enumerate(due):
            if i in ended:
                tok = ended[i]
            else:
                frame = next(it)
                tok = next_token(self.ids, frame, st.ids[p])
                st.sampled[p] = frame
                st.turn_frames += 1
                if tok == self.ids.eos_token and not (st.input_complete and not st.pending):
                    # the turn's last frame, more to speak: it stands as the audio turn's last position does
                    tok, st.speaking = self.ids.delay_token, False
            st.ids.append(tok)
            flat.append(tok)
            self._next_turn(st)
        return flat

    def _codes_rows(self, ctx, out_codes: torch.Tensor) -> None:
        """Every computed position that sampled a frame (this step or before a recompute) gets it as its row."""
        for rid, a, start, end in ctx.request_spans():
            st = self._requests[rid]
            for p in range(max(start, st.num_prompt - 1), end):
                frame = st.sampled.get(p)
                if frame is not None:
                    out_codes[a + p - start] = torch.tensor(frame, dtype=out_codes.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        flat, self._flat = self._flat, []
        if hidden_states.shape[0] != len(flat):
            raise RuntimeError(f"higgs_audio_v2: {hidden_states.shape[0]} rows to sample, {len(flat)} frames sampled "
                               "by the forward (the stage computes no logits for other rows)")
        logits = torch.full((len(flat), self.vocab_size), float("-inf"), dtype=torch.float32,
                            device=hidden_states.device)
        logits[torch.arange(len(flat)), torch.tensor(flat, dtype=torch.long)] = 0.0
        return logits
