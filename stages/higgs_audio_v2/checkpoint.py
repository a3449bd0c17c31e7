"""Random Higgs Audio v2 checkpoints (the LLM with its DualFFN audio path, the processor's tokenizer and chat template,
the audio tokenizer in `audio_tokenizer/`), written once.

    builtin:tiny-higgs-audio-v2     4 codebooks, a 2-layer LLM, the tiny codec: equality tests
    builtin:tiny-higgs-audio-v2-k8  8 codebooks (another delay pattern), the other tiny codec
    builtin:small-higgs-audio-v2    ~100 M parameters in the real model's proportions (8 codebooks of 1024 codes
                                    + stream bos/eos, the real codec decoder's width): benchmarks

A directory as `HiggsAudioV2ForConditionalGeneration.save_pretrained` writes the model (config.json,
model.safetensors, generation_config.json), with the tokenizer and `chat_template.jinja` as the processor saves
them, and the codec as `HiggsAudioV2TokenizerModel.save_pretrained` writes it under `audio_tokenizer/`: the real
release's layout (`$HIGGS_AUDIO_PATH`). The tokenizer is Qwen2's BPE with the Llama-3 / Higgs special tokens
added (the real model uses Llama-3's vocabulary; the ids differ, the roles are the same).

    python -m stages.higgs_audio_v2.checkpoint [tiny|k8|small]    # build (or find) it and print its path
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from stages.checkpoints.cache import build_once, cache_root, save_tokenizer
from stages.checkpoints.qwen_tokenizer import qwen_bpe_tokenizer
from stages.checkpoints.random_init import TEXT_STD

_RECIPE_VERSION = 2  # v2: the codec recipe v2
_SEED = 2468
# After Qwen2's 151,643 BPE ranks, in this order (ids 151643...).
HIGGS_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|audio_out_bos|>", "<|AUDIO_OUT|>", "<|audio_eos|>", "<|reserved_special_token_6|>",
                 "<|scene_desc_start|>", "<|scene_desc_end|>"]
VOCAB_SIZE = 151680

# The processor's chat template (the real release's `chat_template.jinja`): a system turn, an optional scene, user
# texts and assistant audio turns, and a generation prompt ending in <|audio_out_bos|>.
CHAT_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_message = messages[0]['content']|trim %}
    {%- elif messages[0]['content'] is iterable and messages[0]['content'][0]['type'] == 'text' %}
        {%- set system_message = messages[0]['content'][0]['text']|trim %}
    {%- else %}
        {{- raise_exception("System message content must be a string or contain text type!") }}
    {%- endif %}
    {%- set messages = messages[1:] %}
{%- else %}
    {{- raise_exception("A system message is required but not provided!") }}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- system_message }}
{%- if messages and messages[0]['role'] == 'scene' %}
    {{- "\\n\\n<|scene_desc_start|>\\n" }}
    {%- if messages[0]['content'] is string %}
        {{- messages[0]['content'] | trim }}
    {%- elif messages[0]['content'] is iterable %}
        {%- for content_item in messages[0]['content'] %}
            {%- if content_item['type'] == 'text' %}
                {%- set text_content = content_item['text'] | trim %}
                {{- text_content }}
                {%- if loop.first and not loop.last %}
                    {{- "\\n\\n" }}
                {%- endif %}
                {%- if not loop.first and not loop.last and messages[0]['content'][loop.index]['type'] != 'audio' %}
                    {{- "\\n" }}
                {%- endif %}
            {%- elif content_item['type'] == 'audio' %}
                {{- ' <|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}
                {%- if not loop.last %}
                    {{- "\\n" }}
                {%- endif %}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- "\\n<|scene_desc_end|>" }}
    {%- set messages = messages[1:] %}
{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- if message['content'] is not iterable or message['content'][0]['type'] != 'audio' %}
            {{- raise_exception("Assistant messages must contain audio content only!") }}
        {%- endif %}
        {{- '<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}
    {%- else %}
        {%- if message['content'] is string %}
            {{- message['content'] | trim }}
        {%- elif message['content'] is iterable %}
            {%- for content_item in message['content'] %}
                {%- if content_item['type'] == 'text' %}
                    {{- content_item['text'] | trim }}
                {%- elif content_item['type'] == 'audio' and message['role'] == 'user' %}
                    {{- raise_exception("User messages cannot contain audio content!") }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>' }}
{%- endif %}
"""

# name -> (hidden, layers, heads, kv heads, intermediate, codec size)
VARIANTS = {"tiny": (64, 2, 4, 2, 128, "tiny"), "k8": (64, 2, 4, 2, 96, "tiny8"),
            "small": (512, 8, 8, 4, 1536, "small")}


def higgs_tokenizer():
    tok = qwen_bpe_tokenizer(HIGGS_SPECIAL, HIGGS_SPECIAL)
    tok.bos_token, tok.eos_token, tok.pad_token = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"
    return tok


def higgs_config(variant: str, num_codebooks: int, codebook_size: int):
    """The LLM's config for a codec of `num_codebooks` x `codebook_size` codes (+ stream bos / eos)."""
    from transformers import HiggsAudioV2Config

    hidden, layers, heads, kv, inter, _ = VARIANTS[variant]
    tok = higgs_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in HIGGS_SPECIAL}
    return HiggsAudioV2Config(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads, max_position_embeddings=4096,
        num_codebooks=num_codebooks, codebook_size=codebook_size + 2, audio_stream_bos_id=codebook_size,
        audio_stream_eos_id=codebook_size + 1, audio_token_id=ids["<|AUDIO_OUT|>"],
        audio_bos_token_id=ids["<|audio_out_bos|>"], audio_delay_token_id=ids["<|reserved_special_token_6|>"],
        eos_token_id=ids["<|eot_id|>"], pad_token_id=ids["<|end_of_text|>"], bos_token_id=ids["<|begin_of_text|>"],
        initializer_range=TEXT_STD)


def write_llm(tmp: Path, variant: str, num_codebooks: int, codebook_size: int) -> None:
    """The LLM, tokenizer and chat template into `tmp` (random weights from a fixed seed)."""
    import torch
    from transformers import GenerationConfig, HiggsAudioV2ForConditionalGeneration

    config = higgs_config(variant, num_codebooks, codebook_size)
    torch.manual_seed(_SEED)
    model = HiggsAudioV2ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(TEXT_STD * torch.randn(p.shape, generator=gen))
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(tmp)
    tok = higgs_tokenizer()
    save_tokenizer(tok, tmp)
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def higgs_checkpoint(variant: str = "tiny", cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached checkpoint directory of `variant` (built on first use)."""
    from stages.higgs_audio_v2.codec_checkpoint import higgs_codec_checkpoint

    if variant not in VARIANTS:
        raise ValueError(f"unknown higgs_audio_v2 variant {variant!r}; known: {', '.join(VARIANTS)}")
    final = cache_root(cache_dir) / f"higgs-audio-v2-{variant}-v{_RECIPE_VERSION}"

    def build(tmp: Path) -> dict:
        import json
        import shutil

        codec = higgs_codec_checkpoint(VARIANTS[variant][5], cache_dir)
        cfg = json.loads((codec / "config.json").read_text())
        quantizers = _num_quantizers(cfg)
        write_llm(tmp, variant, quantizers, int(cfg.get("codebook_size", 1024)))
        shutil.copytree(codec, tmp / "audio_tokenizer", ignore=shutil.ignore_patterns("omni_checkpoint.json"))
        return {"variant": variant, "seed": _SEED}

    return build_once(final, build)


def _num_quantizers(cfg: dict) -> int:
    from transformers.models.higgs_audio_v2_tokenizer.configuration_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerConfig)

    return int(HiggsAudioV2TokenizerConfig(**{k: v for k, v in cfg.items() if k not in ("model_type",)})
               .num_quantizers)


if __name__ == "__main__":
    print(higgs_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
