"""Qwen3-ASR as a stage: audio in, the transcript's tokens out, as `Qwen3ASRForConditionalGeneration.generate`.

    prompt     the processor's (stages/qwen3_asr/prompt.py): the context, the clip's placeholder run, the forced
               language; the clip's placeholders are its encoder rows (stages/qwen3_asr/audio.py); a prompt given
               as token ids is taken as it is, its placeholder runs matched to its clips in order
    encoder    transformers' own audio tower and projector (`get_audio_features`) on one clip at a time, through the
               encoder cache keyed by the clip's content hash (stages/common/encoder_cache.py): a request that
               re-sends a clip, or one whose clip straddles a prefix-cached block and a fresh one, runs no encoder
    decoder    transformers' `Qwen3Model` (plain 1-D rotary positions) on omni's paged KV cache through the attention
               function registered in `AttentionInterface`; a step's rows inside a clip's placeholder run take the
               clip's encoder rows, as transformers' masked_scatter does for the whole prompt

The clips are hashed into the block hashes (multimodal extra keys), so prompts that differ only in their audio share
no block past the audio's start. The model stops at <|im_end|> (its eos); the released generation config stops
at <|endoftext|> too: the stage configs name it in `stop_token_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from omni.engine.core.request import MultiModalFeature
from omni.engine.memory import StageGeometry, checkpoint_geometry
from omni.engine.runner.attention import register_attention
from omni.engine.runner.forward_context import get_forward_context
from omni.engine.runner.output_head import prepare_cpu_head
from omni.engine.stage_model import AutoregressiveStageModel, KVSpec, PreparedPrompt
from omni.errors import RequestError
from omni.messages import StageInput

from stages.common.decoder import decoder_kv_spec
from stages.common.encoder_cache import DEFAULT_ENTRIES, EncoderCache
from stages.common.media import media_names
from stages.common.mm_items import MMItem, expand_placeholders
from stages.qwen3_asr.audio import audio_item
from stages.qwen3_asr.info import ASR
from stages.qwen3_asr.prompt import forced_language, last_clip, render_prompt


@dataclass(slots=True)
class _Clips:
    """One request's clips (sorted by offset), kept from `preprocess` to `remove_request`."""

    items: list[MMItem]


class Qwen3ASRStage(AutoregressiveStageModel):
    info = ASR
    # Decode steps replay CUDA graphs: a generated token is a plain 1-D-positioned token, never inside a clip's
    # placeholders. Prompt tokens (the encoder rows go in) always run eager.
    supports_cuda_graphs = True
    graphs_need_generated_tokens = True

    def __init__(self, model, tokenizer, extractor, device: torch.device, dtype: torch.dtype,
                 encoder_cache_size: int = DEFAULT_ENTRIES, in_conversation: bool = False):
        self.model = model
        # The ears of a voice agent (model_kwargs.in_conversation): its prompt is the agent's conversation, and it
        # transcribes the clip of the last user turn alone, with no context (the conversation, and its tools, are
        # the LLM's).
        self.in_conversation = in_conversation
        if in_conversation:
            self.info = replace(type(self).info, passes_tools_on=True)
        self.tokenizer = tokenizer
        self.extractor = extractor
        self.device, self.dtype = device, dtype
        cfg = model.config
        self.text_config = tc = cfg.text_config
        self.lm = model.model.language_model
        self.embed_tokens = self.lm.embed_tokens
        self.hidden_size = tc.hidden_size
        self.vocab_size = tc.vocab_size
        self.max_model_len = int(tc.max_position_embeddings)
        self.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.audio_token_id = cfg.audio_token_id
        self.n_window = int(cfg.audio_config.n_window)
        self.encoder_cache = EncoderCache(encoder_cache_size)
        self._requests: dict[str, _Clips] = {}

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None) -> "Qwen3ASRStage":
        from transformers import AutoTokenizer, Qwen3ASRFeatureExtractor, Qwen3ASRForConditionalGeneration

        kwargs = dict(model_kwargs or {})
        cache_size = int(kwargs.pop("encoder_cache_size", DEFAULT_ENTRIES))
        in_conversation = bool(kwargs.pop("in_conversation", False))
        model = Qwen3ASRForConditionalGeneration.from_pretrained(str(model_path), dtype=dtype,
                                                                 attn_implementation="sdpa", **kwargs)
        model.to(device).eval()
        # Paged attention for the decoder only; the audio encoder keeps sdpa over its own windows.
        model.model.language_model.config._attn_implementation = register_attention()
        prepare_cpu_head(model.lm_head, device)  # decode logits at memory speed
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        extractor = Qwen3ASRFeatureExtractor.from_pretrained(str(model_path))
        return cls(model, tokenizer, extractor, device, dtype, cache_size, in_conversation)

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> StageGeometry | None:
        return checkpoint_geometry(model_path, "text_config")

    @classmethod
    def encoder_cache_bytes(cls, model_kwargs: dict[str, Any], geometry: StageGeometry, dtype_bytes: int,
                            item_rows: int) -> int:
        return EncoderCache.bytes_at_fullest(model_kwargs, geometry, dtype_bytes, item_rows)

    def kv_spec(self) -> KVSpec:
        return decoder_kv_spec(self.text_config)

    def stats(self) -> dict[str, int]:
        return self.encoder_cache.stats()

    # ------------------------------------------------------------ per request
    def preprocess(self, inp: StageInput) -> PreparedPrompt:
        if self.in_conversation:
            heard = last_clip(inp)
            if heard is None:  # a typed turn: nothing to transcribe, an empty transcript at once
                ids = list(self.tokenizer("<|im_start|>assistant\n")["input_ids"])
                return PreparedPrompt(ids, forced_reply=[self.eos_token_id])
            inp = heard
        items = [audio_item(m, self.extractor, self.n_window, self.max_model_len, where)
                 for m, where in zip(inp.mm_inputs, media_names(inp.mm_inputs))]
        if inp.prompt_token_ids is not None:
            if forced_language(inp) is not None:
                where = "mm_processor_kwargs.language"
                raise RequestError(f"{where}: the prompt's token ids are taken as they are; give the context as "
                                   "`prompt` to force a language", field=where)
            ids = [int(t) for t in inp.prompt_token_ids]
        else:
            ids = list(self.tokenizer(render_prompt(inp))["input_ids"])
        ids = expand_placeholders(ids, items, {"audio": self.audio_token_id})
        items.sort(key=lambda it: it.offset)
        feats = [MultiModalFeature(it.mm_hash, it.offset, it.num_tokens, it.modality) for it in items]
        return PreparedPrompt(ids, feats, None, {"clips": _Clips(items)})

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: StageInput) -> None:
        clips = prompt.extra.get("clips") if prompt is not None else None
        if clips is not None and clips.items:
            self._requests[request_id] = clips

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---------------------------------------------------------------- encoder
    def encode(self, item: MMItem) -> torch.Tensor:
        """The clip's projected encoder rows [num_tokens, hidden], through the encoder cache."""
        hit = self.encoder_cache.get(item.mm_hash)
        if hit is not None:
            return hit
        feats = item.data.to(self.device, self.model.model.audio_tower.dtype)
        mask = (torch.arange(feats.shape[-1], device=self.device) < item.frames).long()
        rows = self.model.get_audio_features(feats[None], mask[None], return_dict=True).pooler_output.to(self.dtype)
        if rows.shape[0] != item.num_tokens:
            raise ValueError(f"audio encoder produced {rows.shape[0]} rows for {item.num_tokens} placeholders")
        self.encoder_cache.put(item.mm_hash, rows)
        return rows

    # ---------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, inputs_embeds, positions) -> dict[str, torch.Tensor]:
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self._requests:
            for rid, a, start, end in get_forward_context().request_spans():
                clips = self._requests.get(rid)
                for item in clips.items if clips is not None else ():
                    lo, hi = max(start, item.offset), min(end, item.offset + item.num_tokens)
                    if lo >= hi:
                        continue
                    if embeds is inputs_embeds:  # never write into the caller's tensor
                        embeds = embeds.clone()
                    embeds[a + lo - start : a + hi - start] = self.encode(item)[lo - item.offset : hi - item.offset]
        out = self.lm(inputs_embeds=embeds[None], position_ids=positions[None], use_cache=False)
        return {"hidden_states": out.last_hidden_state[0]}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden_states).float()
