"""Qwen2.5-Omni talker as a stage: thinker embeddings + hidden states in, codec tokens out.

Mirrors transformers' `Qwen2_5OmniForConditionalGeneration.generate` for one request:

    prompt rows   thinker_hidden[i] + thinker_embed[i]   (embeddings of image/audio rows zeroed)
                  embed(speaker bos) + codec_embed(pad)
                  thinker_hidden[L] + thinker_embed(g0) + codec_embed(codec bos)
    prompt ids    [codec_mask] * L + [codec_pad, codec_bos]
    decode step j codec_embed(c_j) + reply[j]    reply = rows of g1.., then text eos, then text pad
    positions     the thinker's 3-D prompt positions, then +1, +2; generated: p + delta

transformers 5.x's `generate` loses the talker's attention mask on the way to its forward, and
with it two steps of that forward: the codec pad/bos embeddings are not added to the last two
prompt rows and the positions are plain 0, 1, 2, ... on all three axes. `transformers_compat`
(model_kwargs, default True) reproduces that, token for token; False gives the behaviour the
forward's code (and the original Qwen2.5-Omni release) intends, as listed above.

The prompt rows (in the thinker's hidden width, before `thinker_to_talker_proj`) are this stage's
`prompt_embeds`, so the engine hashes them into the block keys: a talker prefix hits only when the
thinker's states for it were identical. `compute_logits` suppresses the codec bos token, as
transformers' generate does.

Streaming (a `stream: true` edge from the thinker): the prompt is complete once the thinker has
sampled two tokens (reply[0] needs the hidden row of g0), so the talker starts then; later chunks
only add reply rows, and decode step j waits until reply row j exists (`compute_limit`) or the
thinker has finished (then the text eos / pad rows follow, as in the one-shot prompt). The rows and
positions are the same as the one-shot path's, so the codes are too.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
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

from stages.common.decoder import decoder_kv_spec
from stages.common.mrope import fill_mrope_positions
from stages.common.parts import load_thinker_embedding
from stages.common.processors import expect_payload
from stages.common.talker_feed import ReplyRows
from stages.qwen2_5_omni.payloads import ThinkerToTalker
from stages.qwen2_5_omni.loading import load_omni_part
from stages.qwen2_5_omni.info import TALKER

DEFAULT_SPEAKER = "Chelsie"


def load_speakers(model_path: Path) -> dict[str, dict[str, Any]]:
    path = Path(model_path) / "spk_dict.pt"
    if not path.is_file():
        raise ValueError(f"model_path: {model_path} has no spk_dict.pt (the Qwen2.5-Omni speaker dictionary)")
    return torch.load(path, weights_only=True)


def speaker_params(speakers: dict[str, dict[str, Any]], name: str | None) -> dict[str, Any]:
    """A speaker's parameters by name, matched case-insensitively (as Qwen3-Omni's talker matches them, and as
    `omni serve` checks a request's voice against the stage's `voices`)."""
    name = name or DEFAULT_SPEAKER
    found = speakers.get(name) or next((v for k, v in speakers.items() if k.lower() == name.lower()), None)
    if found is None:
        raise RequestError(f"speaker: {name!r} is not available; choose one of {sorted(speakers)}", field="speaker")
    return found


@dataclass(slots=True)
class _TalkerRequest:
    positions: torch.Tensor  # [3, num_prompt] int64
    delta: int
    reply: torch.Tensor  # [R, thinker_hidden]: added to the codec embedding of generated token j (min(j, R-1))
    # Streaming input only: the thinker tokens so far and how many reply rows exist; `complete`
    # once the thinker finished (its eos/pad rows are then in `reply`).
    gen: list[int] | None = None
    num_reply: int = 0
    complete: bool = True
    pending: torch.Tensor | None = None  # thinker rows that arrived before their token
    _buf: torch.Tensor | None = None

    def append_reply(self, rows: torch.Tensor) -> None:
        """Grow `reply` (capacity doubles: k chunks cost O(total) copies)."""
        n, k = self.reply.shape[0], rows.shape[0]
        buf = self._buf if self._buf is not None else self.reply
        if buf.shape[0] < n + k:
            bigger = torch.empty((max(2 * buf.shape[0], n + k, 16), *rows.shape[1:]), dtype=self.reply.dtype,
                                 device=self.reply.device)
            bigger[:n] = self.reply
            buf = bigger
        buf[n : n + k] = rows.to(buf.dtype)
        self._buf = buf
        self.reply = buf[: n + k]


class Qwen2_5OmniTalkerStage(AutoregressiveStageModel):
    checkpoint_prefix = "talker."
    tokenizer = None
    info = TALKER

    def __init__(self, talker, thinker_embed: torch.nn.Embedding, speakers: dict, device, dtype,
                 mm_token_ids: tuple[int, ...], transformers_compat: bool = True):
        self.talker = talker
        self.transformers_compat = transformers_compat
        self.thinker_embed = thinker_embed
        self.speakers = speakers
        self.info = replace(TALKER, voices=tuple(sorted(speakers)))  # what `omni serve` checks a voice against
        self.device, self.dtype = device, dtype
        cfg = self.config = talker.config
        self.codec_embed = talker.model.embed_tokens
        # Prompt rows arrive in the thinker's space (embedding_size); the talker's
        # own hidden states are hidden_size wide.
        self.prompt_embed_size = cfg.embedding_size
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_model_len = int(cfg.max_position_embeddings)
        self.eos_token_id = talker.codec_eos_token
        self.mm_token_ids = mm_token_ids
        self._requests: dict[str, _TalkerRequest] = {}

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import Qwen2_5OmniConfig, Qwen2_5OmniTalkerForConditionalGeneration

        kwargs = dict(model_kwargs or {})
        compat = bool(kwargs.pop("transformers_compat", True))
        talker, full = load_omni_part(Path(model_path), "talker", Qwen2_5OmniTalkerForConditionalGeneration,
                                      dtype, device, **kwargs)
        talker.model.config._attn_implementation = register_attention()
        prepare_cpu_head(talker.codec_head, device)  # decode logits at memory speed
        tc = full.thinker_config
        mm = (tc.image_token_id, tc.audio_token_id, tc.video_token_id)
        embedding = load_thinker_embedding(Qwen2_5OmniConfig, Path(model_path), dtype, device)
        return cls(talker, embedding, load_speakers(Path(model_path)), device, dtype, mm, compat)

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> StageGeometry | None:
        return checkpoint_geometry(model_path, "talker_config")

    def kv_spec(self) -> KVSpec:
        return decoder_kv_spec(self.config)

    # ------------------------------------------------------------ per request
    def _embed_text(self, ids: list[int]) -> torch.Tensor:
        return self.thinker_embed(torch.tensor(ids, dtype=torch.long, device=self.device)).float()

    def profile_inputs(self, lengths: list[int]) -> list[StageInput]:
        """Requests whose talker prompts have `lengths` tokens, shaped as thinker2talker builds them (a
        prompt of L thinker rows + 2 codec tokens, two thinker tokens): omni plan's profile step."""
        width = self.prompt_embed_size or self.hidden_size
        out = []
        for i, n in enumerate(lengths):
            L, gen = max(1, n - 2), [0, 0]
            rows = L + len(gen)
            positions = np.repeat(np.arange(rows, dtype=np.float32)[:, None], 3, axis=1)
            payload = ThinkerToTalker(prompt_ids=[0] * L, output_ids=gen, hidden=np.zeros((rows, width), np.float32),
                                      positions=positions)
            out.append(StageInput(f"__profile_talker_{i}", sampling_params={"max_tokens": 1, "ignore_eos": True},
                                  payload=payload))
        return out

    @torch.inference_mode()
    def preprocess(self, inp: StageInput) -> PreparedPrompt:
        ex = expect_payload(inp, ThinkerToTalker, "thinker2talker")
        prompt = [int(t) for t in ex.prompt_ids]
        gen = [int(t) for t in ex.output_ids]
        L, n = len(prompt), len(gen)
        hidden = torch.as_tensor(np.asarray(ex.hidden, dtype=np.float32), device=self.device)
        if n < 2:
            raise RequestError(f"payload.output_ids: the talker needs >= 2 thinker tokens (got {n})",
                               field="payload.output_ids", code=REPLY_TOO_SHORT_TO_VOICE, actual=n, limit=2)
        if hidden.shape[0] < L + 1:
            raise ValueError(f"payload.output_ids: the talker needs >= 2 thinker tokens and their hidden states "
                             f"(got {n} tokens, {hidden.shape[0]} rows for a {L}-token prompt)")
        spk = speaker_params(self.speakers, ex.speaker)
        streaming = ex.streaming
        emb = self._embed_text(prompt)
        is_mm = torch.tensor([t in self.mm_token_ids for t in prompt], device=self.device)
        emb[is_mm] = 0.0  # transformers zeroes the image/audio/video rows of the embeddings it hands over
        # Hidden row L + k belongs to the thinker's input token g_k (the last sampled token has none).
        num_reply = min(n - 1, hidden.shape[0] - L)
        reply = hidden[L : L + num_reply] + self._embed_text(gen[:num_reply])
        codec = self.codec_embed(torch.tensor([self.talker.codec_pad_token, self.talker.codec_bos_token],
                                              device=self.device)).float()
        if self.transformers_compat:
            codec = torch.zeros_like(codec)
        rows = torch.cat([hidden[:L] + emb,
                          self._embed_text([int(spk["bos_token"])]) + codec[:1],
                          reply[:1] + codec[1:]])
        rest = reply[1:] if streaming else torch.cat([reply[1:], self._tail()])
        tpos = torch.as_tensor(np.asarray(ex.positions), dtype=torch.long)[:L].t()
        if self.transformers_compat:
            tpos = torch.arange(L, dtype=torch.long).repeat(3, 1)
        top = int(tpos.max()) if L else -1
        positions = torch.cat([tpos, torch.tensor([[top + 1, top + 2]] * 3, dtype=torch.long)], dim=1)
        ids = [self.talker.codec_mask_token] * L + [self.talker.codec_pad_token, self.talker.codec_bos_token]
        state = _TalkerRequest(positions, top + 1 - L, rest.to(self.dtype))
        if streaming:
            state.gen, state.num_reply, state.complete = gen, num_reply, False
        return PreparedPrompt(ids, [], rows.cpu().numpy().astype(np.float32), {"talker": state})

    def _tail(self) -> torch.Tensor:
        """The rows after the thinker's reply: its text end token, then text pad (repeated)."""
        cfg = self.config
        return self._embed_text([cfg.tts_text_end_token_id, cfg.tts_text_pad_token_id])

    @torch.inference_mode()
    def extend_request(self, request_id: str, payload: ReplyRows | None, last: bool) -> None:
        """More of the thinker's output: reply row k = hidden row L + k + embedding of token g_k."""
        st = self._requests.get(request_id)
        if st is None or st.complete:
            raise ValueError(f"request_id: {request_id!r} takes no more thinker output")
        st.gen.extend(int(t) for t in (payload.output_ids if payload is not None else ()))
        hidden = payload.rows if payload is not None else None
        if hidden is not None and len(hidden):
            rows = torch.as_tensor(np.asarray(hidden, dtype=np.float32), device=self.device)
            st.pending = rows if st.pending is None else torch.cat([st.pending, rows])
        if st.pending is not None:
            k0 = st.num_reply
            k1 = min(k0 + st.pending.shape[0], len(st.gen))  # a row is used once its token is there
            if k1 > k0:
                st.append_reply((st.pending[: k1 - k0] + self._embed_text(st.gen[k0:k1])).to(self.dtype))
                st.pending = st.pending[k1 - k0:]
                st.num_reply = k1
        if last:
            st.append_reply(self._tail().to(self.dtype))
            st.complete = True

    def compute_limit(self, request_id: str) -> int | None:
        st = self._requests.get(request_id)
        if st is None or st.complete:
            return None
        # Output token j (position num_prompt + j) is fed with reply row j.
        return st.positions.shape[1] + st.reply.shape[0]

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: StageInput) -> None:
        if prompt is not None:
            self._requests[request_id] = prompt.extra["talker"]

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.codec_embed(input_ids)

    def forward(self, input_ids, inputs_embeds, positions) -> dict[str, torch.Tensor]:
        ctx = get_forward_context()
        embeds = self.codec_embed(input_ids) if inputs_embeds is None else inputs_embeds.clone()
        pos3 = positions.detach().cpu().long().unsqueeze(0).repeat(3, 1)
        for rid, a, start, end in ctx.request_spans():
            st = self._requests.get(rid)
            if st is None:
                continue
            num_prompt = st.positions.shape[1]
            fill_mrope_positions(pos3, a, start, end, st.positions, st.delta)
            if end > num_prompt:
                first = max(start, num_prompt)
                j = (torch.arange(first, end) - num_prompt).clamp(max=st.reply.shape[0] - 1)
                embeds[a + first - start : a + end - start] += st.reply[j.to(st.reply.device)].to(embeds.dtype)
        x = self.talker.thinker_to_talker_proj(embeds)
        out = self.talker.model(inputs_embeds=x[None], position_ids=pos3[:, None].to(x.device), use_cache=False)
        return {"hidden_states": out.last_hidden_state[0]}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.talker.codec_head(hidden_states).float()
        logits[:, self.talker.codec_bos_token] = float("-inf")  # transformers: suppress_tokens=[codec bos]
        return logits
