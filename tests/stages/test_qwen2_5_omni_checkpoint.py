"""The tiny random Qwen2.5-Omni checkpoint: shapes, speaker dict, tokenizer, builtin resolution."""
from __future__ import annotations

import torch
from transformers import AutoTokenizer, Qwen2_5OmniConfig


def test_tiny_checkpoint_layout(tiny_omni):
    cfg = Qwen2_5OmniConfig.from_pretrained(str(tiny_omni))
    text = cfg.thinker_config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    talker = cfg.talker_config
    assert sum(talker.rope_parameters["mrope_section"]) == talker.head_dim // 2
    assert talker.embedding_size == text.hidden_size
    big = cfg.token2wav_config.bigvgan_config
    assert big.upsample_initial_channel >= 2 ** len(big.upsample_rates)
    spk = torch.load(tiny_omni / "spk_dict.pt", weights_only=True)
    assert {"Chelsie", "Ethan"} <= set(spk)
    for params in spk.values():
        assert params["bos_token"] < text.vocab_size
        assert params["cond"].shape == (cfg.token2wav_config.dit_config.enc_emb_dim,)
        assert params["ref_mel"].shape[-1] == cfg.token2wav_config.dit_config.mel_dim
    tok = AutoTokenizer.from_pretrained(str(tiny_omni))
    ids = tok("<|vision_bos|><|IMAGE|><|vision_eos|><|audio_bos|><|AUDIO|><|audio_eos|>")["input_ids"]
    assert ids == [151652, 151655, 151653, 151647, 151646, 151648]
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645


def test_builtin_name_resolves(tiny_omni):
    from omni.registry import resolve_model_path

    assert resolve_model_path("builtin:tiny-qwen2_5-omni") == tiny_omni
