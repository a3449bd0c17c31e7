"""Random Qwen3-ASR checkpoints (audio encoder, projector, Qwen3 decoder) with the processor, written once.

    builtin:tiny-qwen3-asr    (`qwen3_asr_checkpoint("tiny")`): a 2-layer encoder whose attention windows span two
                              encoder chunks (a 10 s clip spans several), a 3-layer decoder: equality tests
    builtin:small-qwen3-asr   (`qwen3_asr_checkpoint("small")`): ~120 M parameters in the released models'
                              proportions (an 8-layer encoder of 384 wide, an 8-layer decoder of 512 with GQA, the
                              real 800-frame attention windows), for benchmarks where the encoder and prefill cost
                              real time
    (see stages/checkpoints/cache.py for the cache)

A directory exactly as `Qwen3ASRForConditionalGeneration.save_pretrained` writes the model (config.json,
model.safetensors, generation_config.json) and `Qwen3ASRProcessor.save_pretrained` the processor (its feature
extractor's preprocessor_config.json, the tokenizer, chat_template.jinja): the layout of the released
`Qwen/Qwen3-ASR-*-hf` directories (`$QWEN3_ASR_PATH`), so that our stage and transformers' own `from_pretrained`
load the same files. The chat template is the released one (transformers' conversion script writes it).

Token ids are the real ones where the model or its prompt uses them: ChatML 151643-151645, <|audio_start|> 151669,
<|audio_end|> 151670, <|audio_pad|> 151676 (config.audio_token_id), <asr_text> 151704 (a plain added token: it
survives skip_special_tokens, which the processor's parser relies on), <timestamp> 151705; the ids between them,
which nothing here uses, hold reserved tokens so that every id lands where the real tokenizer has it.

    python -m stages.qwen3_asr.checkpoint [tiny|small]    # build (or find) it and print its path
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from stages.checkpoints.cache import build_once, cache_root, save_tokenizer
from stages.checkpoints.qwen_tokenizer import QWEN2_ADDED_TOKENS, QWEN2_SPECIAL, qwen_bpe_tokenizer
from stages.checkpoints.random_init import ENCODER_STD, TEXT_STD

_RECIPE_VERSION = 1
_SEED = 8642
VOCAB_SIZE = 151936  # the released models' embedding rows
AUDIO_TOKENS = {"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                "audio_eos_token": "<|audio_end|>"}
IDS = {"<|audio_start|>": 151669, "<|audio_end|>": 151670, "<|audio_pad|>": 151676, "<asr_text>": 151704,
       "<timestamp>": 151705}

# The released template (transformers' convert_qwen3_asr_to_hf.py ASR_CHAT_TEMPLATE): every system text joined into
# one system turn (always written), one audio placeholder per audio part of any message in the user turn, then
# the assistant turns (a forced-language prefill) and the generation prompt.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system_text='') -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}"
    "{%- if m.content is string -%}{%- set ns.system_text = ns.system_text + m.content -%}"
    "{%- else -%}{%- for c in m.content -%}{%- if c.type == 'text' and (c.text is defined) -%}"
    "{%- set ns.system_text = ns.system_text + c.text -%}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set ns2 = namespace(audio_tokens='') -%}"
    "{%- for m in messages -%}{%- if m.content is not string -%}{%- for c in m.content -%}"
    "{%- if c.type == 'audio' or ('audio' in c) or ('audio_url' in c) -%}"
    "{%- set ns2.audio_tokens = ns2.audio_tokens + '<|audio_start|><|audio_pad|><|audio_end|>' -%}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
    "{{- '<|im_start|>system\\n' + ns.system_text + '<|im_end|>\\n' -}}"
    "{{- '<|im_start|>user\\n' + ns2.audio_tokens + '<|im_end|>\\n' -}}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
    "{%- set ns3 = namespace(assistant_text='') -%}"
    "{%- if m.content is string -%}{%- set ns3.assistant_text = m.content -%}"
    "{%- else -%}{%- for c in m.content -%}{%- if c.type == 'text' and (c.text is defined) -%}"
    "{%- set ns3.assistant_text = ns3.assistant_text + c.text -%}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}{% generation %}{{- ns3.assistant_text + '<|im_end|>\\n' -}}"
    "{% endgeneration %}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# name -> (audio: layers, heads, d_model, ffn, conv width, window frames; text: layers, heads, kv heads, hidden, ffn)
VARIANTS = {"tiny": (2, 2, 32, 64, 16, 200, 3, 4, 2, 64, 128),
            "small": (8, 6, 384, 1536, 128, 800, 8, 8, 4, 512, 1536)}


def qwen3_asr_tokenizer():
    """Qwen2 byte-level BPE + Qwen3-ASR's added tokens at their ids (module docstring), the processor's audio
    tokens named (`tokenizer.audio_token`, ...)."""
    first = 151643 + len(QWEN2_SPECIAL) + len(QWEN2_ADDED_TOKENS)
    later = ["<tool_response>", "</tool_response>", "<think>", "</think>"]
    for token, at in IDS.items():
        later += [f"<|reserved_{i}|>" for i in range(first + len(later), at)] + [token]
    special = QWEN2_SPECIAL + [t for t in later if t != "<asr_text>"]
    tok = qwen_bpe_tokenizer(QWEN2_SPECIAL + QWEN2_ADDED_TOKENS + later, special, AUDIO_TOKENS)
    assert all(tok.convert_tokens_to_ids(t) == i for t, i in IDS.items())
    return tok


def qwen3_asr_config(variant: str = "tiny"):
    from transformers import Qwen3ASRConfig

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    a_layers, a_heads, d_model, a_ffn, conv, window, t_layers, heads, kv, hidden, ffn = VARIANTS[variant]
    audio = dict(num_mel_bins=128, encoder_layers=a_layers, encoder_attention_heads=a_heads, encoder_ffn_dim=a_ffn,
                 d_model=d_model, output_dim=hidden, n_window=50, n_window_infer=window,
                 downsample_hidden_size=conv, initializer_range=ENCODER_STD)
    text = dict(model_type="qwen3", vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=ffn,
                num_hidden_layers=t_layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                tie_word_embeddings=True, initializer_range=TEXT_STD, pad_token_id=151645, eos_token_id=151645)
    return Qwen3ASRConfig(audio_config=audio, text_config=text, audio_token_id=IDS["<|audio_pad|>"],
                          timestamp_token_id=IDS["<timestamp>"])


def _randomize(model, gen) -> None:
    """Decoder weights at a std large enough that greedy decoding wanders, encoder and projector smaller (so the
    audio rows neither vanish nor swamp the prompt), norms around 1, biases small."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                std = TEXT_STD if ".language_model." in name else ENCODER_STD
                p.copy_(std * torch.randn(p.shape, generator=gen))


def qwen3_asr_checkpoint(variant: str = "tiny", cache_dir: str | os.PathLike | None = None) -> Path:
    """A random Qwen3-ASR checkpoint directory (a VARIANTS name), built on first use."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")

    def build(tmp: Path) -> dict:
        import torch
        from transformers import (GenerationConfig, Qwen3ASRFeatureExtractor, Qwen3ASRForConditionalGeneration,
                                  Qwen3ASRProcessor)

        with torch.random.fork_rng(devices=[]):  # the model's own init must not move the caller's RNG
            torch.manual_seed(_SEED)
            model = Qwen3ASRForConditionalGeneration(qwen3_asr_config(variant)).float().eval()
            _randomize(model, torch.Generator().manual_seed(_SEED))
        # the released generation config (eos: <|endoftext|> and <|im_end|>)
        model.generation_config = GenerationConfig(eos_token_id=[151643, 151645], pad_token_id=151645,
                                                   do_sample=False, max_new_tokens=512)
        model.save_pretrained(tmp)
        tok = qwen3_asr_tokenizer()
        Qwen3ASRProcessor(feature_extractor=Qwen3ASRFeatureExtractor(), tokenizer=tok,
                          chat_template=CHAT_TEMPLATE).save_pretrained(tmp)
        save_tokenizer(tok, tmp)
        return {"arch": "qwen3_asr", "variant": variant, "seed": _SEED,
                "parameters": sum(p.numel() for p in model.parameters())}

    return build_once(cache_root(cache_dir) / f"{variant}-qwen3-asr-v{_RECIPE_VERSION}", build)


if __name__ == "__main__":
    print(qwen3_asr_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
