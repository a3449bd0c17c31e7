"""Any Hugging Face decoder-only LM (Llama, Qwen2, Qwen3, SmolLM2, ...) as a stage.

Loaded with transformers from a local directory (safetensors) or a GGUF file,
with omni's paged attention registered as the attention implementation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni.engine.runner.attention import register_attention
from omni.engine.memory import StageGeometry, checkpoint_geometry
from omni.engine.runner.cpu_linear import pack_cpu_linears
from omni.engine.runner.output_head import prepare_cpu_head
from omni.engine.stage_model import AutoregressiveStageModel, KVSpec

from stages.common.decoder import decoder_kv_spec


def _split_gguf(model_path: Path) -> tuple[Path, str | None]:
    if model_path.is_file() and model_path.suffix == ".gguf":
        return model_path.parent, model_path.name
    return model_path, None


class CausalLMStage(AutoregressiveStageModel):
    supports_cuda_graphs = True  # a plain decoder: tensors in, tensors out

    def __init__(self, model: torch.nn.Module, tokenizer: Any, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        cfg = model.config
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_model_len = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = cfg.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        self.eos_token_id = eos
        # The decoder (embeddings + layers + final norm) and the LM head, found
        # through transformers' generic accessors so any decoder LM works.
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
            raise ValueError(f"{cfg.model_type}: sliding-window attention is not supported by omni yet")

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None,
             tokenizer_path: Path | None = None) -> "CausalLMStage":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        attn = register_attention()
        directory, gguf_file = _split_gguf(Path(model_path))
        kwargs = dict(model_kwargs or {})
        if gguf_file:
            kwargs["gguf_file"] = gguf_file
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype, attn_implementation=attn, **kwargs
        )
        model.to(device).eval()
        prepare_cpu_head(model.get_output_embeddings(), device)  # decode logits at memory speed
        pack_cpu_linears(model.get_decoder(), device)  # decode steps stop re-packing weights
        tok_dir = Path(tokenizer_path) if tokenizer_path else directory
        tok_kwargs = {"gguf_file": gguf_file} if (gguf_file and tokenizer_path is None) else {}
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), **tok_kwargs)
        except (OSError, ValueError):
            tokenizer = None  # token-id-only stages (e.g. a talker) need none
        return cls(model, tokenizer, device, dtype)

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> StageGeometry | None:
        return checkpoint_geometry(model_path) or checkpoint_geometry(model_path, "text_config")

    def kv_spec(self) -> KVSpec:
        return decoder_kv_spec(self.config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, inputs_embeds, positions) -> dict[str, torch.Tensor]:
        out = self.decoder(
            input_ids=None if input_ids is None else input_ids.unsqueeze(0),
            inputs_embeds=None if inputs_embeds is None else inputs_embeds.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
        )
        return {"hidden_states": out.last_hidden_state[0]}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.float()
