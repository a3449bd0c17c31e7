"""Qwen2.5-Omni thinker as a stage: text + image + audio in, text tokens and hidden states out.

Per request (kept from `preprocess` to `remove_request`): the preprocessed image/audio inputs and
the 3-D multimodal rotary positions of the prompt (transformers' `get_rope_index`); generated
tokens continue at `position + delta` on all three axes, as transformers does while decoding.

In a packed step, `forward` reads the batch layout from the ForwardContext, fills each request's
scheduled span with text embeddings, scatters the vision/audio encoder outputs over the
placeholder rows that fall inside the span, and builds the [3, 1, T] position ids. Encoder outputs
live in an LRU cache keyed by the input's content hash: a request whose image straddles a
prefix-cached block and a fresh one re-runs no encoder (the vLLM encoder-cache idea).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
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

from stages.common.parts import load_part
from stages.common.media import media_names
from stages.qwen2_5_omni.inputs import (MMItem, expand_placeholders, fill_mrope_positions, load_preprocess_config, messages_for,
                                  mm_num_tokens, preprocess_mm, render_chat)

THINKER_EOS = 151645  # <|im_end|>


def load_omni_part(model_path: Path, part: str, cls: type, dtype: torch.dtype, device: torch.device,
                   attn: str = "sdpa", **kwargs: Any):
    """Load one part ("thinker" / "talker" / "token2wav") of a full Qwen2.5-Omni checkpoint: (part, full config)."""
    from transformers import Qwen2_5OmniConfig

    return load_part(Qwen2_5OmniConfig, model_path, part, cls, dtype, device, attn, **kwargs)


@dataclass(slots=True)
class _ThinkerRequest:
    items: list[MMItem]
    positions: torch.Tensor  # [3, num_prompt_tokens] int64
    delta: int  # generated token at sequence index p has position p + delta (all three axes)
    num_prompt: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_prompt = self.positions.shape[1]


def text_model(thinker):
    """The thinker's decoder: `thinker.model.language_model` since transformers 5.2x,
    `thinker.model` itself before (5.17 still runs on our GPU machines)."""
    return getattr(thinker.model, "language_model", thinker.model)


def audio_tower(thinker):
    tower = getattr(thinker, "audio_tower", None)
    return tower if isinstance(tower, torch.nn.Module) else thinker.model.audio_tower


class Qwen2_5OmniThinkerStage(AutoregressiveStageModel):
    checkpoint_prefix = "thinker."  # its tensors in the full checkpoint (the planner reads their headers)
    # Decode steps replay CUDA graphs: a generated token's three rotary positions are all its index plus its
    # request's `delta`, which `before_graph_replay` puts into a device buffer that the captured forward adds.
    # Prompt tokens (their own 3-D positions, encoder rows) always run eager.
    supports_cuda_graphs = True
    graphs_need_generated_tokens = True

    def __init__(self, thinker, tokenizer, device: torch.device, dtype: torch.dtype, preprocess_cfg: dict,
                 encoder_cache_size: int = 128):
        self.thinker = thinker
        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        self.preprocess_cfg = preprocess_cfg
        cfg = thinker.config
        self.text_config = tc = cfg.text_config
        self.lm = text_model(thinker)
        self.embed_tokens = self.lm.embed_tokens
        self.lm_head = thinker.lm_head
        self.hidden_size = tc.hidden_size
        self.vocab_size = tc.vocab_size
        self.max_model_len = int(tc.max_position_embeddings)
        eos = getattr(getattr(thinker, "generation_config", None), "eos_token_id", None) or THINKER_EOS
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.image_token_id = cfg.image_token_id
        self.audio_token_id = cfg.audio_token_id
        self.encoder_cache_size = encoder_cache_size
        self.encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoder_runs = 0
        self.encoder_cache_hits = 0
        self._requests: dict[str, _ThinkerRequest] = {}
        self._graph_delta: torch.Tensor | None = None  # [max_num_seqs] int64: each replayed row's delta

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

        kwargs = dict(model_kwargs or {})
        cache_size = int(kwargs.pop("encoder_cache_size", 128))
        thinker, _ = load_omni_part(Path(model_path), "thinker", Qwen2_5OmniThinkerForConditionalGeneration,
                                    dtype, device, **kwargs)
        # Paged attention for the decoder only; the vision/audio encoders keep sdpa over their own inputs.
        text_model(thinker).config._attn_implementation = register_attention()
        prepare_cpu_head(thinker.lm_head, device)  # decode logits at memory speed
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        return cls(thinker, tokenizer, device, dtype, load_preprocess_config(Path(model_path)), cache_size)

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> StageGeometry | None:
        return checkpoint_geometry(model_path, "thinker_config", "text_config")

    @classmethod
    def encoder_cache_bytes(cls, model_kwargs: dict[str, Any], geometry: StageGeometry, dtype_bytes: int,
                            item_rows: int) -> int:
        """The encoder cache at its fullest: `encoder_cache_size` entries (as `load` reads it), each one
        media item's encoder output of at most `item_rows` rows of hidden_size in the stage's dtype."""
        return int(model_kwargs.get("encoder_cache_size", 128)) * item_rows * geometry.hidden_size * dtype_bytes

    def kv_spec(self) -> KVSpec:
        tc = self.text_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        return KVSpec(tc.num_hidden_layers, tc.num_key_value_heads, head_dim)

    # ------------------------------------------------------------ per request
    def preprocess(self, inp: StageInput) -> PreparedPrompt:
        names = media_names(inp.mm_inputs)
        media_tokens = 0
        for m, where in zip(inp.mm_inputs, names):  # before any pixel value is made: they are the big part
            media_tokens += mm_num_tokens(m, self.preprocess_cfg)
            if media_tokens > self.max_model_len:
                raise ValueError(f"{where}: the prompt's media take {media_tokens} placeholder tokens up to this "
                                 f"one, more than the model's {self.max_model_len} positions")
        items = [preprocess_mm(m, self.preprocess_cfg, where) for m, where in zip(inp.mm_inputs, names)]
        if inp.prompt_token_ids is not None:
            ids = [int(t) for t in inp.prompt_token_ids]
        elif inp.prompt is not None:
            text = render_chat(messages_for(inp.prompt, inp.mm_inputs), self.preprocess_cfg["system_prompt"])
            ids = list(self.tokenizer(text)["input_ids"])
        else:
            raise RequestError("prompt: the thinker needs `prompt` (text or chat messages) or `prompt_token_ids`",
                               field="prompt")
        ids = expand_placeholders(ids, items, self.image_token_id, self.audio_token_id)
        positions, delta = self.rope_index(ids, items)
        feats = sorted((MultiModalFeature(it.mm_hash, it.offset, it.num_tokens, it.modality) for it in items), key=lambda f: f.offset)
        return PreparedPrompt(ids, feats, None, {"thinker": _ThinkerRequest(items, positions, delta)})

    def rope_index(self, ids: list[int], items: list[MMItem]) -> tuple[torch.Tensor, int]:
        """transformers' own 3-D rotary positions of one prompt: ([3, L] int64, delta)."""
        x = torch.tensor([ids], dtype=torch.long)
        grids = [it.grid_thw for it in items if it.modality == "image"]
        audio_lens = [it.frames for it in items if it.modality == "audio"]
        pos, delta = self.thinker.get_rope_index(
            x, torch.stack(grids) if grids else None, None, torch.ones_like(x), False,
            torch.tensor(audio_lens, dtype=torch.long) if audio_lens else None, None)
        return pos[:, 0].long().cpu(), int(delta.reshape(-1)[0])

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: StageInput) -> None:
        if prompt is not None:
            self._requests[request_id] = prompt.extra["thinker"]

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---------------------------------------------------------------- encoders
    def encode(self, item: MMItem) -> torch.Tensor:
        """Encoder output rows [num_tokens, hidden] of one input, through the LRU encoder cache."""
        hit = self.encoder_cache.get(item.mm_hash)
        if hit is not None:
            self.encoder_cache.move_to_end(item.mm_hash)
            self.encoder_cache_hits += 1
            return hit
        model = self.thinker  # get_*_features live here in every transformers 5.x
        if item.modality == "image":
            out = model.get_image_features(item.data.to(self.device), item.grid_thw[None].to(self.device),
                                           return_dict=True).pooler_output[0]
        else:
            feats = item.data.to(self.device, audio_tower(self.thinker).dtype)[None]
            mask = torch.ones(1, feats.shape[-1], dtype=torch.long, device=self.device)
            out = model.get_audio_features(feats, feature_attention_mask=mask, return_dict=True).last_hidden_state
        out = out.to(self.dtype)
        if out.shape[0] != item.num_tokens:
            raise ValueError(f"{item.modality} encoder produced {out.shape[0]} rows for {item.num_tokens} placeholders")
        self.encoder_runs += 1
        self.encoder_cache[item.mm_hash] = out
        while len(self.encoder_cache) > self.encoder_cache_size:
            self.encoder_cache.popitem(last=False)
        return out

    # ---------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

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
                    rows = self.encode(item)[lo - item.offset : hi - item.offset]
                    embeds[a + lo - start : a + hi - start] = rows.to(embeds.dtype)
        out = self.lm(inputs_embeds=embeds[None], position_ids=pos3[:, None].to(embeds.device), use_cache=False)
        # The talker needs the prompt's rotary positions: a per-token output, cached like hidden states.
        return {"hidden_states": out.last_hidden_state[0],
                "mrope_positions": pos3.t().to(embeds.device, torch.float32)}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def stats(self) -> dict[str, int]:
        return self.encoder_stats()

    def encoder_stats(self) -> dict[str, int]:
        return {"encoder_runs": self.encoder_runs, "encoder_cache_hits": self.encoder_cache_hits,
                "encoder_cache_entries": len(self.encoder_cache)}
