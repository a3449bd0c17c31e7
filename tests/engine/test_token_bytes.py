"""TokenBytes: each token's own bytes (logprobs' `bytes`), not the UTF-8 of its text decoded alone, which for a
token holding part of a multi-byte character is U+FFFD."""
from __future__ import annotations

from omni.engine.io.token_bytes import TokenBytes

TEXT = "naïve café: 日本語 🦩🪼 ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done"  # the flamingo, ꙮ, the fraktur: split across tokens


def test_byte_level_tokens_join_into_the_texts_bytes(tiny_qwen2):
    """A byte-level BPE vocabulary (Qwen2): the tokens' bytes, joined, are the text's UTF-8, even where a character
    spans tokens (each of those decodes alone to U+FFFD); added tokens are their own text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen2))
    token_bytes = TokenBytes(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(token_bytes(i) for i in ids) == TEXT.encode("utf-8")
    partial = [i for i in ids if tok.decode([i]) == "\ufffd"]
    assert partial  # the characters TEXT names are split across tokens: the case this is for
    assert all(token_bytes(i) != "\ufffd".encode() and len(token_bytes(i)) < 4 for i in partial)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(eos) == b"<|im_end|>"


def test_sentencepiece_byte_fallback_tokens_are_their_byte():
    """A SentencePiece-style vocabulary (Llama's: `▁` for a space, `<0xE6>` byte-fallback tokens): a byte-fallback
    token is its one byte, `▁` a space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<0xE6>": 1, "<0x97>": 2, "<0xA5>": 3, "\u2581a": 4, "b": 5}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    token_bytes = TokenBytes(tok)
    assert [token_bytes(i) for i in (1, 2, 3, 4, 5)] == [b"\xe6", b"\x97", b"\xa5", b" a", b"b"]
    assert b"".join(token_bytes(i) for i in (1, 2, 3)).decode() == "日"
