"""Real recorded speech for the Qwen3-ASR tests (the Moonshine package's sample: 10 s of a man reading Beckett at
16 kHz) cut into clips of different lengths, and transformers' reference for one request."""
from __future__ import annotations

import numpy as np

from tests.serve.realtime_utils import speech_wav

EOS_TEXT = 151643  # <|endoftext|>: the released generation config's second eos
MAX_TOKENS = 12


def speech() -> np.ndarray:
    import soundfile as sf

    wave, rate = sf.read(str(speech_wav()), dtype="float32")
    assert rate == 16000 and wave.ndim == 1
    return wave


def clips() -> dict[str, np.ndarray]:
    """Clips of 0.2 s (shorter than the extractor's min_length: zero-padded), 2.5 s, 4.1 s and the whole 10 s (several
    encoder attention windows of the tiny checkpoint)."""
    wave = speech()
    return {"short": wave[16000:19200], "a": wave[:40000], "b": wave[40000:105600], "whole": wave}


def hf_generate(model, processor, clip: np.ndarray, language: str | None = None, context: str | None = None,
                max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy reply ids) of transformers' generate on one clip, as the processor prepares it."""
    import torch

    inputs = processor.apply_transcription_request(clip, language=language, prompt=context)
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return ids, out[0, len(ids):].tolist()


def shown_text(processor, ids: list[int]) -> str:
    """The processor's decode of a reply, less the U+FFFD it shows for a character the reply's last tokens begin and
    do not end (the engine's detokenizer, as vLLM's, never shows one: the character is not there yet)."""
    import codecs

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    text = processor.decode(ids, skip_special_tokens=True)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tok = processor.tokenizer
    pieces = [t for i, t in zip(ids, tok.convert_ids_to_tokens(ids)) if i not in tok.all_special_ids]
    raw = bytes(byte_of[c] for c in "".join(pieces) if c in byte_of)
    held = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=False)
    return text.removesuffix("\ufffd") if held != raw.decode("utf-8", errors="replace") else text
