"""Qwen3-Omni thinker as a stage: a MoE decoder, text in, text tokens + the talker's per-token inputs out.

The decoder is transformers' own `Qwen3OmniMoeThinkerTextModel` (its MoE blocks route the packed
varlen batch with transformers' experts implementation: grouped by expert, no loop over tokens), run
on omni's paged KV cache through the attention function registered in `AttentionInterface`.

Per token the forward emits, besides the last hidden states:

    embeds         the decoder's input rows (hidden_states[0] of transformers' generate)
    accept_hidden  the output of layer `talker_config.accept_hidden_layer` (hidden_states[k])

which are what transformers' `Qwen3OmniMoeForConditionalGeneration.generate` hands the talker. They
are discovered per-token outputs, so they live in the stage tensor cache: a request that hits the
prefix cache still hands the talker the rows of its whole sequence.

Inputs: text or chat messages (rendered in ChatML, as Qwen3-Omni's chat template does) or token ids, and
audio: each clip becomes `<|audio_start|>` + one `<|audio_pad|>` per audio-encoder output row +
`<|audio_end|>` (Whisper log-mel features, the row count from transformers' own
`_get_feat_extract_output_lengths`), is hashed into the block hashes, and its encoder rows (LRU cache
keyed by the clip's content hash) replace the placeholder rows inside whatever span a step computes.
Text and audio prompts have plain positions on all three rotary axes (transformers' `get_rope_index`
gives arange without image/video grids). Images and video are refused (RequestError naming
`multi_modal_data`): the vision encoder and its deepstack features are not wired into this stage yet.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from omni.engine.attention import register_attention
from omni.engine.forward_context import get_forward_context
from omni.engine.memory import StageGeometry, checkpoint_geometry
from omni.engine.output_head import use_column_major_head
from omni.engine.request import MultiModalFeature
from omni.engine.stage_model import AutoregressiveStageModel, KVSpec, PreparedPrompt
from omni.errors import RequestError
from omni.outputs import StageInput

from .media import media_names
from .qwen2_5_omni_inputs import MMItem, expand_placeholders, mm_hash, preprocess_audio

THINKER_EOS = 151645  # <|im_end|>
AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"
AUDIO_CONFIG = {"audio_sampling_rate": 16000, "num_mel_bins": 128}  # Qwen3-Omni's Whisper feature extractor


def load_qwen3_omni_part(model_path: Path, part: str, cls: type, dtype: torch.dtype, device: torch.device,
                         attn: str = "sdpa", **kwargs: Any):
    """Load one part ("thinker" / "talker" / "code2wav") of a full Qwen3-Omni checkpoint; returns (part, full config)."""
    from transformers import Qwen3OmniMoeConfig
    from transformers.utils import logging as hf_logging

    full = Qwen3OmniMoeConfig.from_pretrained(str(model_path))
    config = getattr(full, f"{part}_config")
    # The other parts' weights are "unexpected" for this one: keep transformers' load report quiet.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = cls.from_pretrained(str(model_path), config=config, dtype=dtype, attn_implementation=attn,
                                    key_mapping={rf"^{part}\.": ""}, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval(), full


def render_chatml(messages: list[dict[str, Any]], system_prompt: str | None) -> str:
    """Qwen3-Omni's chat format for text messages, ending with the assistant's generation prompt."""
    parts = []
    if system_prompt and (not messages or messages[0].get("role") != "system"):
        parts.append(f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
    for i, msg in enumerate(messages):
        content = msg.get("content", "")
        if isinstance(content, list):
            text = ""
            for j, item in enumerate(content):
                kind = item.get("type", "text")
                if kind == "audio":
                    text += AUDIO_PLACEHOLDER
                elif kind == "text":
                    text += item.get("text", "")
                else:
                    raise RequestError(f"prompt[{i}].content[{j}].type: the Qwen3-Omni thinker takes text and audio "
                                       f"(got {kind!r}; image and video inputs are not supported yet)",
                                       field=f"prompt[{i}].content[{j}].type")
            content = text
        parts.append(f"<|im_start|>{msg['role']}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class Qwen3OmniThinkerStage(AutoregressiveStageModel):

    def __init__(self, thinker, tokenizer, device: torch.device, dtype: torch.dtype, accept_hidden_layer: int,
                 system_prompt: str | None = None, encoder_cache_size: int = 128):
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
        self.audio_n_window = int(thinker.config.audio_config.n_window)
        self.encoder_cache_size = encoder_cache_size
        self.encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoder_runs = 0
        self.encoder_cache_hits = 0
        self._requests: dict[str, list[MMItem]] = {}

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import AutoTokenizer, Qwen3OmniMoeThinkerForConditionalGeneration

        kwargs = dict(model_kwargs or {})
        system_prompt = kwargs.pop("system_prompt", None)
        cache_size = int(kwargs.pop("encoder_cache_size", 128))
        thinker, full = load_qwen3_omni_part(Path(model_path), "thinker", Qwen3OmniMoeThinkerForConditionalGeneration,
                                             dtype, device, **kwargs)
        # Paged attention for the decoder only; the vision/audio encoders keep sdpa over their own inputs.
        thinker.model.language_model.config._attn_implementation = register_attention()
        use_column_major_head(thinker.lm_head, device)  # decode logits at memory speed
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        return cls(thinker, tokenizer, device, dtype, int(full.talker_config.accept_hidden_layer), system_prompt,
                   cache_size)

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
        refused = [(m.modality, where) for m, where in zip(inp.mm_inputs, names) if m.modality != "audio"]
        if refused:
            raise RequestError(f"multi_modal_data: the Qwen3-Omni thinker stage takes text and audio; {refused[0][0]} "
                               f"inputs ({refused[0][1]}) are not supported yet", field="multi_modal_data")
        items = [self.audio_item(m, where) for m, where in zip(inp.mm_inputs, names)]
        if inp.prompt_token_ids is not None:
            ids = [int(t) for t in inp.prompt_token_ids]
        elif inp.prompt is not None:
            ids = list(self.tokenizer(render_chatml(self.messages(inp.prompt, len(items)),
                                                    self.system_prompt))["input_ids"])
        else:
            raise RequestError("prompt: the thinker needs `prompt` (text or chat messages) or `prompt_token_ids`",
                               field="prompt")
        # The image id is never in a text/audio prompt: only audio placeholders are expanded.
        ids = expand_placeholders(ids, items, -1, self.audio_token_id)
        feats = [MultiModalFeature(it.mm_hash, it.offset, it.num_tokens) for it in items]
        return PreparedPrompt(ids, feats, None, {"audio": items})

    @staticmethod
    def messages(prompt: Any, num_audio: int) -> list[dict[str, Any]]:
        """Chat messages of a prompt; audio clips with no placeholder go first in the last user turn."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("prompt: give a string or a list of chat messages ({'role', 'content'})", field="prompt")
        placed = sum(1 for m in messages if isinstance(m.get("content"), list)
                     for part in m["content"] if isinstance(part, dict) and part.get("type") == "audio")
        if num_audio and not placed:
            users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
            if not users:
                raise RequestError("multi_modal_data: the messages have no user turn to attach the audio to",
                                   field="multi_modal_data")
            messages = [dict(m) for m in messages]
            content = messages[users[-1]].get("content", "")
            text = content if isinstance(content, list) else [{"type": "text", "text": content}]
            messages[users[-1]]["content"] = [{"type": "audio"}] * num_audio + text
        return messages

    def audio_item(self, inp, where: str) -> MMItem:
        """A clip's log-mel features and its number of placeholder tokens (the audio encoder's output rows)."""
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

        feats = preprocess_audio(inp.data, inp.sampling_rate, AUDIO_CONFIG, where)
        n = int(_get_feat_extract_output_lengths(torch.tensor(feats.shape[1]), self.audio_n_window))
        if n > self.max_model_len:
            raise RequestError(f"{where}: the clip takes {n} placeholder tokens, more than the model's "
                               f"{self.max_model_len} positions", field=where)
        return MMItem("audio", mm_hash(inp), n, feats)

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: StageInput) -> None:
        if prompt is not None and prompt.extra.get("audio"):
            self._requests[request_id] = prompt.extra["audio"]

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def encode(self, item: MMItem) -> torch.Tensor:
        """Audio encoder rows [num_tokens, hidden] of one clip, through the LRU encoder cache."""
        hit = self.encoder_cache.get(item.mm_hash)
        if hit is not None:
            self.encoder_cache.move_to_end(item.mm_hash)
            self.encoder_cache_hits += 1
            return hit
        feats = item.data.to(self.device, self.thinker.model.audio_tower.dtype)[None]
        mask = torch.ones(1, feats.shape[-1], dtype=torch.long, device=self.device)
        out = self.thinker.get_audio_features(feats, feature_attention_mask=mask, return_dict=True).last_hidden_state
        out = out.to(self.dtype)
        if out.shape[0] != item.num_tokens:
            raise ValueError(f"audio encoder produced {out.shape[0]} rows for {item.num_tokens} placeholders")
        self.encoder_runs += 1
        self.encoder_cache[item.mm_hash] = out
        while len(self.encoder_cache) > self.encoder_cache_size:
            self.encoder_cache.popitem(last=False)
        return out

    def stats(self) -> dict[str, int]:
        return {"encoder_runs": self.encoder_runs, "encoder_cache_hits": self.encoder_cache_hits,
                "encoder_cache_entries": len(self.encoder_cache)}

    # ---------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, inputs_embeds, positions) -> dict[str, torch.Tensor]:
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self._requests:
            ctx = get_forward_context()
            for rid, a, start, end in ctx.request_spans():
                for item in self._requests.get(rid, ()):
                    lo, hi = max(start, item.offset), min(end, item.offset + item.num_tokens)
                    if lo < hi:
                        if embeds is inputs_embeds:  # never write into the caller's tensor
                            embeds = embeds.clone()
                        embeds[a + lo - start : a + hi - start] = self.encode(item)[lo - item.offset : hi - item.offset]
        # Text-only: the same position on the three rotary axes (interleaved mrope reduces to 1-D rope).
        pos3 = positions.view(1, 1, -1).expand(3, 1, -1)
        out = self.lm(inputs_embeds=embeds[None], position_ids=pos3, use_cache=False, output_hidden_states=True)
        hs = out.hidden_states  # [embeds, layer 1 out, ..., final normed]: transformers' own indexing
        return {"hidden_states": out.last_hidden_state[0], "embeds": hs[0][0],
                "accept_hidden": hs[self.accept_hidden_layer][0]}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()
