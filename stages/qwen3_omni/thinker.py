"""Qwen3-Omni thinker as a stage: a MoE decoder, text in, text tokens + the talker's per-token inputs out.

The decoder is transformers' own `Qwen3OmniMoeThinkerTextModel` (its MoE blocks route the packed
varlen batch with transformers' experts implementation: grouped by expert, no loop over tokens), run
on omni's paged KV cache through the attention function registered in `AttentionInterface`.

Per token the forward emits, besides the last hidden states:

    embeds         the decoder's input rows (hidden_states[0] of transformers' generate)
    accept_hidden  the output of layer `talker_config.accept_hidden_layer` (hidden_states[k])
    mm_meta        [grid t, h, w, audio frames] of the image / clip a placeholder row belongs to; a video's
                   rows (its track's too) [grid t, h, w, seconds per temporal patch] (the
                   talker's 3-D positions need them)

which are what transformers' `Qwen3OmniMoeForConditionalGeneration.generate` hands the talker. They
are discovered per-token outputs, so they live in the stage tensor cache: a request that hits the
prefix cache still hands the talker the rows of its whole sequence.

Inputs: text or chat messages (rendered in ChatML, as Qwen3-Omni's chat template does; with `tools`, in
Qwen3's function-calling format, so `omni serve --enable-auto-tool-choice --tool-call-parser hermes` reads the
calls back) or token ids, images and audio. An image becomes `<|vision_start|>` + one `<|image_pad|>` per merged patch +
`<|vision_end|>` (Qwen2-VL's Pillow image processor at the vision tower's patch size, mean/std 0.5), a
clip `<|audio_start|>` + one `<|audio_pad|>` per audio-encoder row + `<|audio_end|>` (Whisper log-mel
features, the row count from transformers' `_get_feat_extract_output_lengths`). Inputs are hashed into
the block hashes; their encoder rows (the encoder cache, stages/common/encoder_cache.py) replace the placeholder rows
inside whatever span a step computes, and an image's deepstack rows are added after the first decoder
layers at its rows of the step (transformers' `visual_pos_masks` / `deepstack_visual_embeds`). With
images, positions are transformers' `get_rope_index` per request (generated tokens at p + delta);
without, they are plain on all three rotary axes. A video's frames are sampled and preprocessed as
Qwen3OmniMoeProcessor's video path does (1 fps; model_kwargs `video_fps` and `video_limits` change the rate and the
bounds), its rows deepstacked like an image's; with `mm_processor_kwargs.use_audio_in_video` its audio track's rows
are merged with its frames' by time, as the processor lays them out (only the video rows take deepstack rows).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni.engine.runner.attention import register_attention
from omni.engine.runner.forward_context import get_forward_context
from omni.engine.runner.output_head import prepare_cpu_head
from omni.messages import StageInput

from stages.common.encoder_cache import DEFAULT_ENTRIES
from stages.common.mm_items import MMItem
from stages.common.mrope import fill_mrope_positions
from stages.common.thinker import OmniThinkerStage, text_model
from stages.qwen3_omni.info import THINKER
from stages.common.video_decode import VideoLimits
from stages.common.video_items import VideoSpec, merged_layout
from stages.qwen3_omni.inputs import (AUDIO_CONFIG, VIDEO_FPS, chat_messages, image_config, media_item,
                                      render_chatml, video_settings_of)
from stages.qwen3_omni.loading import load_qwen3_omni_part


class Qwen3OmniThinkerStage(OmniThinkerStage):
    checkpoint_prefix = "thinker."  # its tensors in the full checkpoint (the planner reads their headers)
    info = THINKER  # text, images and audio in; renders Qwen3's function-calling format

    def __init__(self, thinker, tokenizer, device: torch.device, dtype: torch.dtype, accept_hidden_layer: int,
                 system_prompt: str | None = None, encoder_cache_size: int = DEFAULT_ENTRIES,
                 max_pixels: int = 12845056, video_fps: float = VIDEO_FPS, video_limits: dict | None = None):
        super().__init__(thinker, thinker.model, tokenizer, device, dtype, encoder_cache_size)
        tc = self.text_config
        if not 0 <= accept_hidden_layer <= tc.num_hidden_layers:
            raise ValueError(f"talker_config.accept_hidden_layer: {accept_hidden_layer} is not a hidden state of the "
                             f"{tc.num_hidden_layers}-layer thinker (0..{tc.num_hidden_layers})")
        self.accept_hidden_layer = accept_hidden_layer
        self.system_prompt = system_prompt
        cfg = thinker.config
        self.image_cfg = image_config(cfg.vision_config, max_pixels)
        self.audio_n_window = int(cfg.audio_config.n_window)
        self.video_spec = VideoSpec(video_settings_of(self.image_cfg, video_fps), VideoLimits.of(video_limits),
                                    self.video_token_id, self.audio_token_id, cfg.audio_start_token_id,
                                    cfg.audio_end_token_id, cfg.position_id_per_seconds, cfg.seconds_per_chunk,
                                    merged_layout, AUDIO_CONFIG["audio_sampling_rate"])

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import AutoTokenizer, Qwen3OmniMoeThinkerForConditionalGeneration

        kwargs = dict(model_kwargs or {})
        system_prompt = kwargs.pop("system_prompt", None)
        cache_size = int(kwargs.pop("encoder_cache_size", DEFAULT_ENTRIES))
        max_pixels = int(kwargs.pop("max_pixels", 12845056))  # the 30B model's preprocessor_config
        video_fps, video_limits = float(kwargs.pop("video_fps", VIDEO_FPS)), kwargs.pop("video_limits", None)
        thinker, full = load_qwen3_omni_part(Path(model_path), "thinker", Qwen3OmniMoeThinkerForConditionalGeneration,
                                             dtype, device, **kwargs)
        # Paged attention for the decoder only; the vision/audio encoders keep sdpa over their own inputs.
        text_model(thinker).config._attn_implementation = register_attention()
        prepare_cpu_head(thinker.lm_head, device)  # decode logits at memory speed
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        return cls(thinker, tokenizer, device, dtype, int(full.talker_config.accept_hidden_layer), system_prompt,
                   cache_size, max_pixels, video_fps, video_limits)

    # ------------------------------------------------------------ per request
    def render_prompt(self, inp: StageInput, items: list[MMItem]) -> str:
        return render_chatml(chat_messages(inp.prompt, [it.modality for it in items]), self.system_prompt, inp.tools)

    def prompt_positions(self, ids: list[int], items: list[MMItem]) -> tuple[torch.Tensor | None, int]:
        """transformers' 3-D positions with images or videos; without, plain positions (Qwen3-Omni's audio rows
        count as text positions)."""
        return self.rope_index(ids, items) if any(it.modality in ("image", "video") for it in items) else (None, 0)

    def mm_item(self, inp, where: str) -> MMItem:
        return media_item(inp, where, self.image_cfg, self.audio_n_window, self.max_model_len)

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, inputs_embeds, positions) -> dict[str, torch.Tensor]:
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        # Without images: the same position on the three rotary axes (interleaved mrope reduces to 1-D rope).
        pos3 = positions.view(1, 1, -1).expand(3, 1, -1)
        kwargs: dict[str, Any] = {}
        if self._requests:
            ctx = get_forward_context()
            cpu_pos = None
            vis_rows: list[torch.Tensor] = []
            deep_parts: list[list[torch.Tensor]] = []
            for rid, a, start, end in ctx.request_spans():
                st = self._requests.get(rid)
                if st is None:
                    continue
                if st.positions is not None:
                    if cpu_pos is None:
                        cpu_pos = positions.detach().cpu().long().unsqueeze(0).repeat(3, 1)
                    fill_mrope_positions(cpu_pos, a, start, end, st.positions, st.delta)
                for item in st.items:  # sorted by offset: visual rows come in packed order
                    lo, hi = max(start, item.offset), min(end, item.offset + item.num_tokens)
                    if lo >= hi:
                        continue
                    if embeds is inputs_embeds:  # never write into the caller's tensor
                        embeds = embeds.clone()
                    rows, deep, visual = self.encode(item)
                    embeds[a + lo - start : a + hi - start] = rows[lo - item.offset : hi - item.offset]
                    if deep is not None:
                        at = torch.arange(a + lo - start, a + hi - start)
                        first, last = lo - item.offset, hi - item.offset  # the item's rows in this span...
                        if visual is not None:  # ...of which the visual ones take deepstack rows
                            at = at[visual[first:last]]
                            first, last = int(visual[:first].sum()), int(visual[:last].sum())
                        vis_rows.append(at)
                        deep_parts = deep_parts or [[] for _ in deep]
                        for k, d in enumerate(deep):
                            deep_parts[k].append(d[first:last])
            if cpu_pos is not None:
                pos3 = cpu_pos[:, None].to(embeds.device)
            if vis_rows:
                # Deepstack: image features added to the hidden states after the first decoder layers, at the
                # image rows of this step (transformers' visual_pos_masks / deepstack_visual_embeds).
                mask = torch.zeros(1, embeds.shape[0], dtype=torch.bool, device=embeds.device)
                mask[0, torch.cat(vis_rows).to(embeds.device)] = True
                kwargs = {"visual_pos_masks": mask, "deepstack_visual_embeds": [torch.cat(p) for p in deep_parts]}
        # Only the two hidden states the talker reads are kept (not every layer's: 48 of them in the 30B model).
        out = self.lm(inputs_embeds=embeds[None], position_ids=pos3, use_cache=False,
                      output_hidden_states=[0, self.accept_hidden_layer], **kwargs)
        hs = out.hidden_states  # [embeds, layer 1 out, ..., final normed]: transformers' own indexing
        return {"hidden_states": out.last_hidden_state[0], "embeds": hs[0][0],
                "accept_hidden": hs[self.accept_hidden_layer][0], "mm_meta": self._mm_meta(embeds.shape[0])}

    def _mm_meta(self, num_tokens: int) -> torch.Tensor:
        """Per token [grid t, grid h, grid w, audio feature frames] of the input whose placeholder it is (zeros
        elsewhere): the talker's 3-D positions need the images' grids and the clips' lengths, and as rows they
        reach it through the tensor cache like every other per-token output."""
        meta = torch.zeros((num_tokens, 4), dtype=torch.float32)
        if self._requests:
            for rid, a, start, end in get_forward_context().request_spans():
                st = self._requests.get(rid)
                for item in st.items if st is not None else ():
                    lo, hi = max(start, item.offset), min(end, item.offset + item.num_tokens)
                    if lo < hi:
                        value = (item.grid_thw.tolist() + [item.second_per_grid] if item.modality != "audio"
                                 else [0, 0, 0, item.frames])
                        meta[a + lo - start : a + hi - start] = torch.tensor(value, dtype=torch.float32)
        return meta.to(self.device)
