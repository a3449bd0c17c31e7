"""Qwen3-Omni thinker as a stage: a MoE decoder, text in, text tokens + the talker's per-token inputs out.

The decoder is transformers' own `Qwen3OmniMoeThinkerTextModel` (its MoE blocks route the packed
varlen batch with transformers' experts implementation: grouped by expert, no loop over tokens), run
on omni's paged KV cache through the attention function registered in `AttentionInterface`.

Per token the forward emits, besides the last hidden states:

    embeds         the decoder's input rows (hidden_states[0] of transformers' generate)
    accept_hidden  the output of layer `talker_config.accept_hidden_layer` (hidden_states[k])
    mm_meta        [grid t, h, w, audio frames] of the image / clip a placeholder row belongs to (the
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
the block hashes; their encoder rows (LRU cache keyed by content hash) replace the placeholder rows
inside whatever span a step computes, and an image's deepstack rows are added after the first decoder
layers at its rows of the step (transformers' `visual_pos_masks` / `deepstack_visual_embeds`). With
images, positions are transformers' `get_rope_index` per request (generated tokens at p + delta);
without, they are plain on all three rotary axes. Video is refused (RequestError naming
`multi_modal_data`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni.engine.runner.attention import register_attention
from omni.engine.runner.forward_context import get_forward_context
from omni.engine.memory import StageGeometry, checkpoint_geometry
from omni.engine.runner.output_head import prepare_cpu_head
from omni.engine.core.request import MultiModalFeature
from omni.engine.stage_model import AutoregressiveStageModel, KVSpec, PreparedPrompt
from omni.errors import RequestError
from omni.messages import StageInput

from stages.common.media import media_names
from stages.qwen2_5_omni.inputs import MMItem, expand_placeholders, fill_mrope_positions
from stages.qwen3_omni.info import THINKER
from stages.qwen3_omni.inputs import chat_messages, image_config, media_item, render_chatml
from stages.qwen3_omni.loading import load_qwen3_omni_part

THINKER_EOS = 151645  # <|im_end|>


@dataclass(slots=True)
class _ThinkerRequest:
    items: list[MMItem]  # sorted by offset
    positions: torch.Tensor | None  # [3, num_prompt] int64 with images; None: plain positions
    delta: int  # generated token at index p has position p + delta (all three axes)


class Qwen3OmniThinkerStage(AutoregressiveStageModel):
    checkpoint_prefix = "thinker."  # its tensors in the full checkpoint (the planner reads their headers)
    info = THINKER  # renders Qwen3's function-calling format

    def __init__(self, thinker, tokenizer, device: torch.device, dtype: torch.dtype, accept_hidden_layer: int,
                 system_prompt: str | None = None, encoder_cache_size: int = 128, max_pixels: int = 12845056):
        self.thinker = thinker
        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        self.text_config = tc = thinker.config.text_config
        self.lm = thinker.model.language_model
        self.embed_tokens = self.lm.embed_tokens
        self.lm_head = thinker.lm_head
        self.hidden_size = tc.hidden_size
        self.vocab_size = tc.vocab_size
        self.max_model_len = int(tc.max_position_embeddings)
        eos = getattr(getattr(thinker, "generation_config", None), "eos_token_id", None) or THINKER_EOS
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        if not 0 <= accept_hidden_layer <= tc.num_hidden_layers:
            raise ValueError(f"talker_config.accept_hidden_layer: {accept_hidden_layer} is not a hidden state of the "
                             f"{tc.num_hidden_layers}-layer thinker (0..{tc.num_hidden_layers})")
        self.accept_hidden_layer = accept_hidden_layer
        self.system_prompt = system_prompt
        self.audio_token_id = thinker.config.audio_token_id
        self.image_token_id = thinker.config.image_token_id
        self.image_cfg = image_config(thinker.config.vision_config, max_pixels)
        self.audio_n_window = int(thinker.config.audio_config.n_window)
        self.encoder_cache_size = encoder_cache_size
        self.encoder_cache: OrderedDict[str, tuple[torch.Tensor, list[torch.Tensor] | None]] = OrderedDict()
        self.encoder_runs = 0
        self.encoder_cache_hits = 0
        self._requests: dict[str, _ThinkerRequest] = {}

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import AutoTokenizer, Qwen3OmniMoeThinkerForConditionalGeneration

        kwargs = dict(model_kwargs or {})
        system_prompt = kwargs.pop("system_prompt", None)
        cache_size = int(kwargs.pop("encoder_cache_size", 128))
        max_pixels = int(kwargs.pop("max_pixels", 12845056))  # the 30B model's preprocessor_config
        thinker, full = load_qwen3_omni_part(Path(model_path), "thinker", Qwen3OmniMoeThinkerForConditionalGeneration,
                                             dtype, device, **kwargs)
        # Paged attention for the decoder only; the vision/audio encoders keep sdpa over their own inputs.
        thinker.model.language_model.config._attn_implementation = register_attention()
        prepare_cpu_head(thinker.lm_head, device)  # decode logits at memory speed
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        return cls(thinker, tokenizer, device, dtype, int(full.talker_config.accept_hidden_layer), system_prompt,
                   cache_size, max_pixels)

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> StageGeometry | None:
        return checkpoint_geometry(model_path, "thinker_config", "text_config")

    def kv_spec(self) -> KVSpec:
        tc = self.text_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        return KVSpec(tc.num_hidden_layers, tc.num_key_value_heads, head_dim)

    # ------------------------------------------------------------ per request
    def preprocess(self, inp: StageInput) -> PreparedPrompt:
        names = media_names(inp.mm_inputs)
        refused = [(m.modality, where) for m, where in zip(inp.mm_inputs, names)
                   if m.modality not in ("audio", "image")]
        if refused:
            raise RequestError(f"multi_modal_data: the Qwen3-Omni thinker stage takes text, image and audio; "
                               f"{refused[0][0]} inputs ({refused[0][1]}) are not supported yet",
                               field="multi_modal_data")
        items = [self.mm_item(m, where) for m, where in zip(inp.mm_inputs, names)]
        if inp.prompt_token_ids is not None:
            ids = [int(t) for t in inp.prompt_token_ids]
        elif inp.prompt is not None:
            ids = list(self.tokenizer(render_chatml(chat_messages(inp.prompt, [it.modality for it in items]),
                                                    self.system_prompt, inp.tools))["input_ids"])
        else:
            raise RequestError("prompt: the thinker needs `prompt` (text or chat messages) or `prompt_token_ids`",
                               field="prompt")
        ids = expand_placeholders(ids, items, self.image_token_id, self.audio_token_id)
        positions, delta = self.rope_index(ids, items) if any(it.modality == "image" for it in items) else (None, 0)
        feats = sorted((MultiModalFeature(it.mm_hash, it.offset, it.num_tokens, it.modality) for it in items),
                       key=lambda f: f.offset)
        return PreparedPrompt(ids, feats, None, {"thinker": _ThinkerRequest(sorted(items, key=lambda it: it.offset),
                                                                           positions, delta)})

    def mm_item(self, inp, where: str) -> MMItem:
        return media_item(inp, where, self.image_cfg, self.audio_n_window, self.max_model_len)

    def rope_index(self, ids: list[int], items: list[MMItem]) -> tuple[torch.Tensor, int]:
        """transformers' own 3-D rotary positions of a prompt with images: ([3, L] int64, delta)."""
        x = torch.tensor([ids], dtype=torch.long)
        grids = [it.grid_thw for it in items if it.modality == "image"]
        audio_lens = [it.frames for it in items if it.modality == "audio"]
        pos, delta = self.thinker.model.get_rope_index(
            x, torch.stack(grids), None, torch.ones_like(x), False,
            torch.tensor(audio_lens, dtype=torch.long) if audio_lens else None, None)
        return pos[:, 0].long().cpu(), int(delta.reshape(-1)[0])

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: StageInput) -> None:
        if prompt is not None and (prompt.extra["thinker"].items or prompt.extra["thinker"].positions is not None):
            self._requests[request_id] = prompt.extra["thinker"]

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def encode(self, item: MMItem) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Encoder rows [num_tokens, hidden] of one input (+ an image's deepstack rows, one per deepstack layer),
        through the LRU encoder cache."""
        hit = self.encoder_cache.get(item.mm_hash)
        if hit is not None:
            self.encoder_cache.move_to_end(item.mm_hash)
            self.encoder_cache_hits += 1
            return hit
        if item.modality == "image":
            out = self.thinker.get_image_features(item.data.to(self.device), item.grid_thw[None].to(self.device),
                                                  return_dict=True)
            rows, deep = out.pooler_output[0].to(self.dtype), [f[0].to(self.dtype) for f in out.deepstack_features]
        else:
            feats = item.data.to(self.device, self.thinker.model.audio_tower.dtype)[None]
            mask = torch.ones(1, feats.shape[-1], dtype=torch.long, device=self.device)
            out = self.thinker.get_audio_features(feats, feature_attention_mask=mask, return_dict=True)
            rows, deep = out.last_hidden_state.to(self.dtype), None
        if rows.shape[0] != item.num_tokens:
            raise ValueError(f"{item.modality} encoder produced {rows.shape[0]} rows for {item.num_tokens} "
                             "placeholders")
        self.encoder_runs += 1
        self.encoder_cache[item.mm_hash] = (rows, deep)
        while len(self.encoder_cache) > self.encoder_cache_size:
            self.encoder_cache.popitem(last=False)
        return rows, deep

    def stats(self) -> dict[str, int]:
        return {"encoder_runs": self.encoder_runs, "encoder_cache_hits": self.encoder_cache_hits,
                "encoder_cache_entries": len(self.encoder_cache)}

    # ---------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

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
                    rows, deep = self.encode(item)
                    embeds[a + lo - start : a + hi - start] = rows[lo - item.offset : hi - item.offset]
                    if deep is not None:
                        vis_rows.append(torch.arange(a + lo - start, a + hi - start))
                        deep_parts = deep_parts or [[] for _ in deep]
                        for k, d in enumerate(deep):
                            deep_parts[k].append(d[lo - item.offset : hi - item.offset])
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
                        value = (item.grid_thw.tolist() + [0] if item.modality == "image"
                                 else [0, 0, 0, item.frames])
                        meta[a + lo - start : a + hi - start] = torch.tensor(value, dtype=torch.float32)
        return meta.to(self.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()
