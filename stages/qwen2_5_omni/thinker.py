"""Qwen2.5-Omni thinker as a stage: text + image + audio + video in, text tokens and hidden states out.

A video's frames are sampled and preprocessed as Qwen2_5OmniProcessor's video path does (2 fps; the model_kwargs
`video_fps` and `video_limits` change the rate and the bounds); with `mm_processor_kwargs.use_audio_in_video` its
audio track's rows are interleaved with its frames' in 2 s chunks (TMRoPE), as the processor lays them out.

Per request (kept from `preprocess` to `remove_request`): the preprocessed image/audio inputs and
the 3-D multimodal rotary positions of the prompt (transformers' `get_rope_index`); generated
tokens continue at `position + delta` on all three axes, as transformers does while decoding.

In a packed step, `forward` reads the batch layout from the ForwardContext, fills each request's
scheduled span with text embeddings, scatters the vision/audio encoder outputs over the
placeholder rows that fall inside the span, and builds the [3, 1, T] position ids. Encoder outputs
live in the encoder cache (stages/common/encoder_cache.py); what both omni thinkers share is in
stages/common/thinker.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni.engine.memory import StageGeometry
from omni.engine.runner.attention import register_attention
from omni.engine.runner.forward_context import get_forward_context
from omni.engine.runner.output_head import prepare_cpu_head
from omni.errors import ContextLengthError
from omni.messages import MultiModalInput, StageInput

from stages.common.encoder_cache import DEFAULT_ENTRIES, EncoderCache
from stages.common.mm_items import MMItem
from stages.common.mrope import fill_mrope_positions
from stages.common.thinker import OmniThinkerStage, text_model
from stages.common.video_decode import VideoLimits
from stages.common.video_items import VideoSpec, chunked_layout
from stages.qwen2_5_omni.info import THINKER
from stages.qwen2_5_omni.inputs import (VIDEO_FPS, load_preprocess_config, messages_for, mm_num_tokens, preprocess_mm,
                                        render_chat, video_settings_of)
from stages.qwen2_5_omni.loading import load_omni_part


class Qwen2_5OmniThinkerStage(OmniThinkerStage):
    checkpoint_prefix = "thinker."  # its tensors in the full checkpoint (the planner reads their headers)
    info = THINKER  # text, images and audio in; no tools
    # Decode steps replay CUDA graphs: a generated token's three rotary positions are all its index plus its
    # request's `delta`, which `before_graph_replay` puts into a device buffer that the captured forward adds.
    # Prompt tokens (their own 3-D positions, encoder rows) always run eager.
    supports_cuda_graphs = True
    graphs_need_generated_tokens = True

    def __init__(self, thinker, tokenizer, device: torch.device, dtype: torch.dtype, preprocess_cfg: dict,
                 encoder_cache_size: int = DEFAULT_ENTRIES, video_fps: float = VIDEO_FPS,
                 video_limits: dict | None = None):
        super().__init__(thinker, thinker, tokenizer, device, dtype, encoder_cache_size)
        self.preprocess_cfg = preprocess_cfg
        cfg = thinker.config
        self.video_spec = VideoSpec(video_settings_of(preprocess_cfg, video_fps), VideoLimits.of(video_limits),
                                    self.video_token_id, self.audio_token_id, cfg.audio_start_token_id,
                                    cfg.audio_end_token_id, cfg.position_id_per_seconds, cfg.seconds_per_chunk,
                                    chunked_layout, preprocess_cfg["audio_sampling_rate"])
        self._graph_delta: torch.Tensor | None = None  # [max_num_seqs] int64: each replayed row's delta

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

        kwargs = dict(model_kwargs or {})
        cache_size = int(kwargs.pop("encoder_cache_size", DEFAULT_ENTRIES))
        video_fps, video_limits = float(kwargs.pop("video_fps", VIDEO_FPS)), kwargs.pop("video_limits", None)
        thinker, _ = load_omni_part(Path(model_path), "thinker", Qwen2_5OmniThinkerForConditionalGeneration,
                                    dtype, device, **kwargs)
        # Paged attention for the decoder only; the vision/audio encoders keep sdpa over their own inputs.
        text_model(thinker).config._attn_implementation = register_attention()
        prepare_cpu_head(thinker.lm_head, device)  # decode logits at memory speed
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        return cls(thinker, tokenizer, device, dtype, load_preprocess_config(Path(model_path)), cache_size, video_fps,
                   video_limits)

    @classmethod
    def encoder_cache_bytes(cls, model_kwargs: dict[str, Any], geometry: StageGeometry, dtype_bytes: int,
                            item_rows: int) -> int:
        return EncoderCache.bytes_at_fullest(model_kwargs, geometry, dtype_bytes, item_rows)

    # ------------------------------------------------------------ per request
    def media_items(self, inp: StageInput, names: list[str]) -> list[MMItem]:
        media_tokens = 0
        for m, where in zip(inp.mm_inputs, names):  # before any pixel value is made: they are the big part
            media_tokens += mm_num_tokens(m, self.preprocess_cfg)
            if media_tokens > self.max_model_len:
                raise ContextLengthError(f"{where}: the prompt's media take {media_tokens} placeholder tokens up to "
                                         f"this one, more than the model's {self.max_model_len} positions",
                                         field=where, limit=self.max_model_len, actual=media_tokens)
        return super().media_items(inp, names)

    def mm_item(self, inp: MultiModalInput, where: str) -> MMItem:
        return preprocess_mm(inp, self.preprocess_cfg, where)

    def render_prompt(self, inp: StageInput, items: list[MMItem]) -> str:
        messages = messages_for(inp.prompt, [it.modality for it in items])
        return render_chat(messages, self.preprocess_cfg["system_prompt"])

    # ---------------------------------------------------------------- forward
    def prepare_cuda_graphs(self, max_num_seqs: int) -> None:
        self._graph_delta = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)

    def before_graph_replay(self, req_ids: list[str], padded: int) -> None:
        deltas = [self._requests[r].delta if r in self._requests else 0 for r in req_ids]
        # A synchronous copy from pageable memory: the next step cannot overwrite what it has not yet read.
        self._graph_delta[: len(deltas)].copy_(torch.tensor(deltas, dtype=torch.long))

    def _graph_forward(self, input_ids, positions) -> dict[str, torch.Tensor]:
        """A decode step as a CUDA graph captures it (a ForwardContext without host state): one generated token
        per row, at position index + delta on all three rotary axes (fill_mrope_positions' rule for them)."""
        pos = positions + self._graph_delta[: positions.shape[0]]
        pos3 = pos.unsqueeze(0).expand(3, -1)
        out = self.lm(inputs_embeds=self.embed_tokens(input_ids)[None], position_ids=pos3[:, None], use_cache=False)
        return {"hidden_states": out.last_hidden_state[0], "mrope_positions": pos3.t().to(torch.float32)}

    def forward(self, input_ids, inputs_embeds, positions) -> dict[str, torch.Tensor]:
        ctx = get_forward_context()
        if ctx.req_ids is None and self._graph_delta is not None and inputs_embeds is None:
            return self._graph_forward(input_ids, positions)
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.clone()
        pos3 = positions.detach().cpu().long().unsqueeze(0).repeat(3, 1)
        for rid, a, start, end in ctx.request_spans():
            st = self._requests.get(rid)
            if st is None:
                continue
            fill_mrope_positions(pos3, a, start, end, st.positions, st.delta)
            for item in st.items:
                lo, hi = max(start, item.offset), min(end, item.offset + item.num_tokens)
                if lo < hi:
                    rows = self.encode(item)[0][lo - item.offset : hi - item.offset]
                    embeds[a + lo - start : a + hi - start] = rows.to(embeds.dtype)
        out = self.lm(inputs_embeds=embeds[None], position_ids=pos3[:, None].to(embeds.device), use_cache=False)
        # The talker needs the prompt's rotary positions: a per-token output, cached like hidden states.
        return {"hidden_states": out.last_hidden_state[0],
                "mrope_positions": pos3.t().to(embeds.device, torch.float32)}
