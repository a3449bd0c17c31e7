"""Qwen3-Omni talker as a stage: the thinker's per-token rows in, codec frames out.

Mirrors transformers' `Qwen3OmniMoeForConditionalGeneration.generate` for one request (image and audio
placeholders take the accept-layer rows through hidden_projection):

    prompt rows   the user turns' positions (every token whose turn's role is `user`):
                      text_projection(thinker embeds)           (hidden_projection(accept_hidden) for media)
                  the last assistant turn: text_projection(embeds of <|im_start|> assistant \\n) + 0,
                      tts_pad x 4 + codec_embed(nothink, think_bos, think_eos, speaker),
                      tts_bos + codec_embed(pad), text_projection(embed of g0) + codec_embed(bos)
    decode step j input = sum of the codec embeddings of frame j (talker codec_embed(c0) + the code
                  predictor's embedding of each residual code) + trailing[j]
                  trailing = text_projection(embeds of g1 .. g_{n-2}), then tts_eos, then tts_pad
    positions     with images or videos: transformers' talker get_rope_index over the talker's own ids (user
                  tokens, then tts_pad), the grids (and a video's seconds per temporal patch) read from the
                  thinker's mm_meta rows; generated p + delta.
                  Without: 0, 1, 2, ... on all three rotary axes
    logits        the top 1024 ids but codec eos are suppressed

Frame j's residual codes come from the code predictor (stages/qwen3_omni/code_predictor.py), run
inside the forward of the position that frame feeds: it needs the talker's last hidden state of the
previous position, kept per request from the forward that computed it, and the sampled c0 (the
position's token). One code-predictor pass serves every request of the step. Each frame is computed once and
kept, so a request recomputed after preemption replays the same frames.

Per-token outputs: `hidden_states` and `codes` (the frame [c0, code 1, ...] that fed each generated
position; -1 on prompt positions), so the code2wav edge reads whole frames from the talker's rows.
The prompt rows are this stage's `prompt_embeds` (in the talker's width), so the block hashes cover
the thinker-derived embeddings; prompt ids are the codec pad id (a suppressed id: the repetition
penalty, which transformers applies to generated codes only, leaves it at -inf).

Streaming (a `stream: true` edge from the thinker): the prompt is complete once the thinker has
sampled two tokens (it needs g0's row); later chunks bring one text row per thinker token, and decode
step j waits until trailing[j] exists (`compute_limit`: the row of g_{j+1} counts once g_{j+2} exists,
since the thinker's last token has no row in transformers) or the thinker has finished (then tts_eos
and tts_pad follow). The rows and positions are the one-shot path's, so the frames are too.

Residual codes follow the request: greedy for a greedy request (transformers' mirror of do_sample),
sampled with transformers' code-predictor settings otherwise (stages/qwen3_omni/code_predictor.py).

Not yet: an image or a video next to a clip in one conversation, and a video with its audio track
(use_audio_in_video): transformers' talker cannot place them (it reads an audio config it does not have, and is
not told use_audio_in_video).
Block hashes cover each generated position's c0 token, not its residual codes: greedy residual codes
are functions of the hashed prefix and c0, so equal hashes mean equal frames; for sampled residual
codes, a generated block is only ever looked up by a request recomputed after preemption (a prompt's
blocks carry embedding digests, generated ones do not), and it could then take another request's
block only if both had the same prompt rows and the same c0 tokens but different residual draws.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni.engine.runner.attention import register_attention
from omni.engine.runner.forward_context import get_forward_context
from omni.engine.memory import StageGeometry, checkpoint_geometry
from omni.engine.runner.output_head import prepare_cpu_head
from omni.engine.stage_model import AutoregressiveStageModel, KVSpec, PreparedPrompt
from omni.errors import REPLY_TOO_SHORT_TO_VOICE, RequestError
from omni.messages import StageInput
from omni.sampling_params import SamplingParams

from stages.common.decoder import decoder_kv_spec
from stages.common.mrope import fill_mrope_positions
from stages.common.parts import load_thinker_embedding
from stages.common.processors import expect_payload
from stages.common.talker_feed import ReplyRows
from stages.qwen3_omni.code_predictor import CodePredictor
from stages.qwen3_omni.payloads import ThinkerToTalker
from stages.qwen3_omni.info import TALKER
from stages.qwen3_omni.loading import load_qwen3_omni_part, register_talker_expert_conversion

DEFAULT_SPEAKER = "Ethan"  # transformers' generate default


@dataclass(slots=True)
class _TalkerRequest:
    num_prompt: int
    # Projected thinker text rows of g1, g2, ... as they arrived (streaming: more come with each chunk).
    text_rows: list[torch.Tensor]
    num_gen: int  # thinker tokens known
    complete: bool = True  # the thinker finished: `trailing` is final
    # Decode step j adds trailing[j] (then tts_pad): text_rows of g1 .. g_{n-2}, then tts_eos once complete.
    trailing: list[torch.Tensor] = field(default_factory=list)
    positions: torch.Tensor | None = None  # [3, num_prompt] with images; None: plain positions
    delta: int = 0  # generated position p has rotary position p + delta
    # How the code predictor draws this request's residual codes (greedy for a greedy request).
    cp_params: Any = None
    cp_generator: torch.Generator | None = None
    frames: list[list[int]] = field(default_factory=list)  # frame j = [c0, code 1, ...], computed once
    # The talker hidden state the next frame's code predictor starts from: that of position
    # num_prompt + len(frames) - 1, kept from the forward that computed it (a request recomputed after
    # preemption reaches the next frame's position in the same forward as that one).
    next_hidden: torch.Tensor | None = None
    next_pos: int = -1


class Qwen3OmniTalkerStage(AutoregressiveStageModel):
    checkpoint_prefix = "talker."
    # An image and an audio clip in one conversation are refused (see "Not yet"): benchmarks read this to
    # choose their media.
    mixed_media = False
    tokenizer = None
    info = TALKER

    def __init__(self, talker, thinker_embed: torch.nn.Embedding, full_config, device, dtype):
        self.talker = talker
        self.thinker_embed = thinker_embed
        self.device, self.dtype = device, dtype
        self.full_config = full_config
        cfg = self.config = full_config.talker_config
        self.info = replace(TALKER, voices=tuple(sorted(cfg.speaker_id or {})))  # what `omni serve` checks a voice against
        tc = self.text_config = cfg.text_config
        self.codec_embed = talker.model.codec_embedding
        self.code_predictor = CodePredictor(talker.code_predictor)
        self.num_groups = int(cfg.num_code_groups)
        self.hidden_size = tc.hidden_size
        self.prompt_embed_size = tc.hidden_size
        self.vocab_size = tc.vocab_size
        self.max_model_len = int(tc.max_position_embeddings)
        self.eos_token_id = int(cfg.codec_eos_token_id)
        self.prompt_token_id = int(cfg.codec_pad_id)
        self.thinker_hidden_size = int(cfg.thinker_hidden_size)
        # transformers' generate: every id of the top 1024 but codec eos is suppressed.
        top = range(tc.vocab_size - 1024, tc.vocab_size)
        self.suppressed = torch.tensor([i for i in top if i != self.eos_token_id], dtype=torch.long, device=device)
        tcfg = full_config.thinker_config
        self.mm_token_ids = (tcfg.audio_token_id, tcfg.image_token_id, tcfg.video_token_id)
        self._requests: dict[str, _TalkerRequest] = {}
        self._embed_ids: torch.Tensor | None = None
        with torch.inference_mode():
            ids = torch.tensor([[full_config.tts_bos_token_id, full_config.tts_eos_token_id,
                                 full_config.tts_pad_token_id]], device=device)
            # One [1, 3] projection, as transformers computes these three rows.
            self.tts_bos, self.tts_eos, self.tts_pad = talker.text_projection(thinker_embed(ids))[0]

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeTalkerForConditionalGeneration

        register_talker_expert_conversion()
        talker, full = load_qwen3_omni_part(Path(model_path), "talker", Qwen3OmniMoeTalkerForConditionalGeneration,
                                            dtype, device, **dict(model_kwargs or {}))
        # Paged attention for the MoE decoder only; the code predictor keeps sdpa over its short frames.
        talker.model.config._attn_implementation = register_attention()
        prepare_cpu_head(talker.codec_head, device)
        embedding = load_thinker_embedding(Qwen3OmniMoeConfig, Path(model_path), dtype, device)
        return cls(talker, embedding, full, device, dtype)

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> StageGeometry | None:
        return checkpoint_geometry(model_path, "talker_config", "text_config")

    def kv_spec(self) -> KVSpec:
        return decoder_kv_spec(self.text_config)

    # ------------------------------------------------------------ per request
    def _rows(self, value: np.ndarray, name: str) -> torch.Tensor:
        arr = np.asarray(value, dtype=np.float32)
        if arr.ndim != 2 or arr.shape[1] != self.thinker_hidden_size:
            raise RequestError(f"payload.{name}: expected [tokens, {self.thinker_hidden_size}] thinker rows, "
                               f"got shape {list(arr.shape)}", field=f"payload.{name}")
        return torch.from_numpy(arr).to(self.device, self.dtype)

    def profile_inputs(self, lengths: list[int]) -> list[StageInput]:
        """Requests whose talker prompts have `lengths` rows, shaped as qwen3_omni_thinker2talker builds them:
        omni plan's profile step. The talker's prompt is the user turn's positions plus 9 rows of the
        assistant turn (preprocess), so a thinker prompt `<|im_start|> user x..x <|im_start|> assistant \\n`
        with n - 9 user positions and two thinker tokens gives n rows."""
        full = self.full_config
        out = []
        for i, n in enumerate(lengths):
            user = [full.im_start_token_id, full.user_token_id] + [0] * max(0, n - 9 - 2)
            prompt = user + [full.im_start_token_id, full.assistant_token_id, 0]
            gen = [0, 0]
            rows = np.zeros((len(prompt) + len(gen) - 1, self.thinker_hidden_size), np.float32)
            payload = ThinkerToTalker(prompt_ids=prompt, output_ids=gen, embeds=rows, accept_hidden=rows[: len(prompt)])
            out.append(StageInput(f"__profile_talker_{i}", sampling_params={"max_tokens": 1, "ignore_eos": True},
                                  payload=payload))
        return out

    @torch.inference_mode()
    def preprocess(self, inp: StageInput) -> PreparedPrompt:
        ex = expect_payload(inp, ThinkerToTalker, "qwen3_omni_thinker2talker")
        cfg, full = self.config, self.full_config
        prompt = [int(t) for t in ex.prompt_ids]
        gen = [int(t) for t in ex.output_ids]
        embeds, hidden = self._rows(ex.embeds, "embeds"), self._rows(ex.accept_hidden, "accept_hidden")
        L, n = len(prompt), len(gen)
        streaming = ex.streaming
        # Streaming: the prompt needs g0's row (L); later rows come with later chunks.
        if n < 2:
            raise RequestError(f"payload.output_ids: the talker needs >= 2 thinker tokens (got {n})",
                               field="payload.output_ids", code=REPLY_TOO_SHORT_TO_VOICE, actual=n, limit=2)
        if embeds.shape[0] < (L + 1 if streaming else L + n - 1) or hidden.shape[0] < L:
            raise RequestError(f"payload.output_ids: the talker needs >= 2 thinker tokens and the rows of all "
                               f"but the last (got {n} tokens, {embeds.shape[0]} rows for a {L}-token prompt)",
                               field="payload.output_ids")
        speaker = str(ex.speaker or DEFAULT_SPEAKER)
        speaker_id = (cfg.speaker_id or {}).get(speaker.lower())
        if speaker_id is None:
            raise RequestError(f"speaker: {speaker!r} is not available; choose one of {sorted(cfg.speaker_id or {})}",
                               field="speaker")
        embeds = embeds[: L + n - 1]
        ids = torch.tensor(prompt)
        im_start = [i for i, t in enumerate(prompt) if t == full.im_start_token_id]
        asst = [i for i in im_start if i + 1 < L and prompt[i + 1] == full.assistant_token_id]
        if not asst or asst[-1] + 3 != L:
            raise RequestError("payload.prompt_ids: the thinker prompt must end with the assistant's generation "
                               "prompt '<|im_start|>assistant\\n'", field="payload.prompt_ids")
        a = asst[-1]
        # The role of each position: the token after the latest <|im_start|> (transformers' user mask).
        starts = torch.where(ids == full.im_start_token_id, torch.arange(L), torch.full((L,), -1))
        role = ids[(torch.cummax(starts, 0).values.clamp_min(0) + 1).clamp_max(L - 1)]
        user = (role == full.user_token_id).nonzero().flatten()
        mm = torch.tensor([t in self.mm_token_ids for t in prompt], device=self.device)
        # transformers projects all the prompt's rows at once (media rows from the accept layer) and picks the
        # user positions: the same calls, for the same rounding.
        full_user = torch.empty((L, self.hidden_size), dtype=self.dtype, device=self.device)
        if mm.any():
            full_user[mm] = self.talker.hidden_projection(hidden[:L][mm])
        full_user[~mm] = self.talker.text_projection(embeds[:L][~mm])
        user_rows = full_user[user.to(self.device)]
        ah = self.talker.text_projection(embeds[a:])  # the assistant turn: <|im_start|> assistant \n g0 g1 ...
        text = torch.cat([ah[:3], self.tts_pad.expand(4, -1), self.tts_bos[None], ah[3:4]])
        codec_ids = torch.tensor([cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id, speaker_id,
                                  cfg.codec_pad_id, cfg.codec_bos_id], device=self.device)
        codec = torch.cat([torch.zeros((3, self.hidden_size), dtype=self.dtype, device=self.device),
                           self.codec_embed(codec_ids)])
        rows = torch.cat([user_rows, text + codec])
        state = _TalkerRequest(rows.shape[0], list(ah[4:]), n, complete=not streaming)
        if any(t in self.mm_token_ids[1:] for t in prompt):  # images, videos: 3-D positions over the talker's ids
            talker_ids = [prompt[i] for i in user.tolist()] + [full.tts_pad_token_id] * (rows.shape[0] - len(user))
            state.positions, state.delta = self._rope_index(talker_ids, [int(i) for i in user.tolist()], ex.mm_meta)
        self._set_trailing(state)
        return PreparedPrompt([self.prompt_token_id] * rows.shape[0], [], rows.float().cpu().numpy(),
                              {"talker": state})

    def _rope_index(self, talker_ids: list[int], user: list[int], meta: np.ndarray | None
                    ) -> tuple[torch.Tensor, int]:
        """transformers' talker positions: its get_rope_index over the talker's ids (user turns + tts_pad), with
        the grids of the images and videos in them (and each video's seconds per temporal patch), read from the
        thinker's mm_meta rows at each placeholder run."""
        if meta is None:
            raise RequestError("payload.mm_meta: an image or video prompt needs the thinker's mm_meta rows "
                               "(use the qwen3_omni_thinker2talker input processor)", field="payload.mm_meta")
        meta = np.asarray(meta)
        audio_id, image_id, video_id = self.mm_token_ids
        grids, videos, seconds, clips = [], [], [], 0
        for k, i in enumerate(user):
            t = talker_ids[k]
            if t == audio_id and meta[i, :3].any():  # a clip row with a video's grid: the video's track
                raise RequestError("mm_processor_kwargs.use_audio_in_video: the Qwen3-Omni talker cannot place a "
                                   "video's audio track (transformers' talker is not told use_audio_in_video and has "
                                   "no audio config); ask for text only, or send the video without its track",
                                   field="mm_processor_kwargs.use_audio_in_video")
            if k and talker_ids[k - 1] == t:
                continue  # not the first row of a run
            if t == image_id:
                grids.append([int(v) for v in meta[i, :3]])
            elif t == video_id:
                videos.append([int(v) for v in meta[i, :3]])
                seconds.append(float(meta[i, 3]))
            elif t == audio_id:
                clips += 1
        if clips:
            # transformers' talker reads `config.audio_config` for clips next to images, which it does not have.
            raise RequestError("multi_modal_data: the Qwen3-Omni talker cannot place an audio clip next to an image "
                               "or a video in one conversation (transformers' talker has no audio config)",
                               field="multi_modal_data")
        x = torch.tensor([talker_ids], dtype=torch.long)
        pos, delta = self.talker.get_rope_index(
            x, torch.tensor(grids, dtype=torch.long) if grids else None,
            torch.tensor(videos, dtype=torch.long) if videos else None, torch.ones_like(x), False, None,
            torch.tensor(seconds) if videos else None)
        return pos[:, 0].long().cpu(), int(delta.reshape(-1)[0])

    def _set_trailing(self, st: _TalkerRequest) -> None:
        # Row of g_{n-1} (the thinker's last token) is never used: transformers has no hidden state for it.
        known = st.text_rows[: max(0, st.num_gen - 2)]
        st.trailing = known + [self.tts_eos] if st.complete else known

    @torch.inference_mode()
    def extend_request(self, request_id: str, payload: ReplyRows | None, last: bool) -> None:
        """More of the thinker's output on a streaming edge: its new tokens and their embeds rows."""
        st = self._requests.get(request_id)
        if st is None or st.complete:
            raise ValueError(f"request_id: {request_id!r} takes no more thinker output")
        st.num_gen += len(payload.output_ids) if payload is not None else 0
        rows = payload.rows if payload is not None else None
        if rows is not None and len(rows):
            st.text_rows.extend(self.talker.text_projection(self._rows(rows, "rows")))
        st.complete = last
        self._set_trailing(st)

    def compute_limit(self, request_id: str) -> int | None:
        st = self._requests.get(request_id)
        if st is None or st.complete:
            return None
        return st.num_prompt + len(st.trailing)  # position num_prompt + j needs trailing[j]

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: StageInput) -> None:
        if prompt is not None:
            st = self._requests[request_id] = prompt.extra["talker"]
            params = inp.sampling_params if isinstance(inp.sampling_params, SamplingParams) else None
            st.cp_params, st.cp_generator = self.code_predictor.params_for(params)

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The runner embeds the step's token ids right before a forward that mixes prompt rows in and then
        # hands the forward embeddings only: the sampled c0 of decode positions are kept from here.
        self._embed_ids = input_ids
        return self.codec_embed(input_ids)

    def forward(self, input_ids, inputs_embeds, positions) -> dict[str, torch.Tensor]:
        ctx = get_forward_context()
        if inputs_embeds is None:
            ids, embeds = input_ids, self.codec_embed(input_ids)
        else:
            ids, embeds = self._embed_ids, inputs_embeds.clone()
            if ids is None or ids.shape[0] != embeds.shape[0]:
                raise RuntimeError("qwen3_omni_talker: the step's token ids were not embedded before its forward")
        self._embed_ids = None
        num_tokens = embeds.shape[0]
        codes = torch.full((num_tokens, self.num_groups), -1.0, dtype=torch.float32, device=embeds.device)
        pending: list[tuple[_TalkerRequest, int, int]] = []  # (request, batch row, frame index)
        decode_rows: list[tuple[_TalkerRequest, int, int]] = []
        for rid, a, start, end in ctx.request_spans():
            st = self._requests.get(rid)
            if st is None:
                continue
            for p in range(max(start, st.num_prompt), end):
                j, row = p - st.num_prompt, a + p - start
                decode_rows.append((st, row, j))
                if j >= len(st.frames):
                    if j != len(st.frames) or st.next_pos != p - 1:
                        raise RuntimeError(f"qwen3_omni_talker: request {rid!r} position {p} needs the hidden state "
                                           f"of position {p - 1} (have {st.next_pos}) to predict frame {j}")
                    pending.append((st, row, j))
        if pending:
            rows = torch.tensor([r for _, r, _ in pending], device=embeds.device)
            c0 = ids[rows]
            past = torch.stack([st.next_hidden for st, _, _ in pending])
            residual = self.code_predictor.predict(past, self.codec_embed(c0), [st.cp_params for st, _, _ in pending],
                                                   [st.cp_generator for st, _, _ in pending])
            for (st, _, _), first, rest in zip(pending, c0.tolist(), residual.tolist()):
                st.frames.append([first, *rest])
        if decode_rows:
            frames = torch.tensor([st.frames[j] for st, _, j in decode_rows], dtype=torch.long, device=embeds.device)
            parts = [self.codec_embed(frames[:, 0])] + self.code_predictor.residual_embeds(frames[:, 1:])
            summed = torch.stack(parts, dim=1).sum(1)  # transformers: cat(codec hiddens).sum(1)
            text = torch.stack([st.trailing[j] if j < len(st.trailing) else self.tts_pad
                                for st, _, j in decode_rows])
            rows = torch.tensor([r for _, r, _ in decode_rows], device=embeds.device)
            embeds[rows] = (summed + text).to(embeds.dtype)
            codes[rows] = frames.to(codes.dtype)
        pos3 = positions.view(1, 1, -1).expand(3, 1, -1)
        if any(st.positions is not None for st in self._requests.values()):
            cpu_pos = positions.detach().cpu().long().unsqueeze(0).repeat(3, 1)
            for rid, a, start, end in ctx.request_spans():
                st = self._requests.get(rid)
                if st is not None and st.positions is not None:
                    fill_mrope_positions(cpu_pos, a, start, end, st.positions, st.delta)
            pos3 = cpu_pos[:, None].to(embeds.device)
        hidden = self.talker.model(inputs_embeds=embeds[None], position_ids=pos3, use_cache=False).last_hidden_state[0]
        for rid, a, start, end in ctx.request_spans():
            st = self._requests.get(rid)
            q = st.num_prompt + len(st.frames) - 1 if st is not None else -1
            if start <= q < end:
                st.next_hidden, st.next_pos = hidden[a + q - start], q
        return {"hidden_states": hidden, "codes": codes}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.talker.codec_head(hidden_states).float()
        logits[:, self.suppressed] = float("-inf")
        return logits
