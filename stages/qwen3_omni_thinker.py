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

Inputs: text or chat messages (rendered in ChatML, as Qwen3-Omni's chat template does) or token ids.
Image, video and audio inputs are refused (RequestError naming `multi_modal_data`): the vision and
audio encoders (and deepstack) are not wired into this stage yet. Text-only prompts have plain
positions on all three rotary axes (transformers' `get_rope_index` gives arange for them).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni.engine.attention import register_attention
from omni.engine.memory import StageGeometry, checkpoint_geometry
from omni.engine.output_head import use_column_major_head
from omni.engine.stage_model import AutoregressiveStageModel, KVSpec, PreparedPrompt
from omni.errors import RequestError
from omni.outputs import StageInput

THINKER_EOS = 151645  # <|im_end|>


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
                if kind != "text":
                    raise RequestError(f"prompt[{i}].content[{j}].type: the Qwen3-Omni thinker takes text only "
                                       f"(got {kind!r}; image, video and audio inputs are not supported yet)",
                                       field=f"prompt[{i}].content[{j}].type")
                text += item.get("text", "")
            content = text
        parts.append(f"<|im_start|>{msg['role']}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class Qwen3OmniThinkerStage(AutoregressiveStageModel):

    def __init__(self, thinker, tokenizer, device: torch.device, dtype: torch.dtype, accept_hidden_layer: int,
                 system_prompt: str | None = None):
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

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import AutoTokenizer, Qwen3OmniMoeThinkerForConditionalGeneration

        kwargs = dict(model_kwargs or {})
        system_prompt = kwargs.pop("system_prompt", None)
        thinker, full = load_qwen3_omni_part(Path(model_path), "thinker", Qwen3OmniMoeThinkerForConditionalGeneration,
                                             dtype, device, **kwargs)
        # Paged attention for the decoder only; the vision/audio encoders keep sdpa over their own inputs.
        thinker.model.language_model.config._attn_implementation = register_attention()
        use_column_major_head(thinker.lm_head, device)  # decode logits at memory speed
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or model_path))
        return cls(thinker, tokenizer, device, dtype, int(full.talker_config.accept_hidden_layer), system_prompt)

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> StageGeometry | None:
        return checkpoint_geometry(model_path, "thinker_config", "text_config")

    def kv_spec(self) -> KVSpec:
        tc = self.text_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        return KVSpec(tc.num_hidden_layers, tc.num_key_value_heads, head_dim)

    # ------------------------------------------------------------ per request
    def preprocess(self, inp: StageInput) -> PreparedPrompt:
        if inp.mm_inputs:
            kinds = sorted({m.modality for m in inp.mm_inputs})
            raise RequestError(f"multi_modal_data: the Qwen3-Omni thinker stage takes text only for now; "
                               f"{'/'.join(kinds)} inputs are not supported yet", field="multi_modal_data")
        if inp.prompt_token_ids is not None:
            ids = [int(t) for t in inp.prompt_token_ids]
        elif inp.prompt is not None:
            messages = [{"role": "user", "content": inp.prompt}] if isinstance(inp.prompt, str) else inp.prompt
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise RequestError("prompt: give a string or a list of chat messages ({'role', 'content'})",
                                   field="prompt")
            ids = list(self.tokenizer(render_chatml(messages, self.system_prompt))["input_ids"])
        else:
            raise RequestError("prompt: the thinker needs `prompt` (text or chat messages) or `prompt_token_ids`",
                               field="prompt")
        return PreparedPrompt(ids)

    # ---------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, inputs_embeds, positions) -> dict[str, torch.Tensor]:
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        # Text-only: the same position on the three rotary axes (interleaved mrope reduces to 1-D rope).
        pos3 = positions.view(1, 1, -1).expand(3, 1, -1)
        out = self.lm(inputs_embeds=embeds[None], position_ids=pos3, use_cache=False, output_hidden_states=True)
        hs = out.hidden_states  # [embeds, layer 1 out, ..., final normed]: transformers' own indexing
        return {"hidden_states": out.last_hidden_state[0], "embeds": hs[0][0],
                "accept_hidden": hs[self.accept_hidden_layer][0]}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()
