"""transformers' Qwen3-Omni as a user without omni runs it: `Qwen3OmniMoeForConditionalGeneration.generate(
return_audio=True, talker_do_sample=False)`, greedy thinker and talker, one request after another (the reference
of `omni bench qwen3-vs-hf`).

Fixed-length replies as omni's bench asks for them: `thinker_min_new_tokens` / `talker_min_new_tokens` equal the
maximums (transformers' MinNewTokensLogitsProcessor masks the eos ids as omni's `min_tokens` does). The codec
frames handed to code2wav (every codebook) are recorded (a wrapper around its chunked_decode) to compare them with
omni's, and `windowed_decode` decodes them again in omni's streaming windows with transformers' own code2wav.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni.bench.references.qwen2_5_omni import load_on, synced

SAMPLE_RATE = 24000  # Qwen3-Omni's code2wav


@dataclass(slots=True)
class HFReply:
    thinker_ids: list[int]
    frames: np.ndarray  # [N, num_code_groups] codec frames transformers decoded
    audio: np.ndarray  # float32 waveform at SAMPLE_RATE (chunked_decode(300, 25), generate's own)
    seconds: float  # wall time of generate()

    @property
    def audio_s(self) -> float:
        return len(self.audio) / SAMPLE_RATE


def load(path: str | Path, device: str = "cpu") -> Any:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return load_on(Qwen3OmniMoeForConditionalGeneration, path, device)


def reply(model: Any, prompt_ids: list[int], thinker_tokens: int, frames: int, *, speaker: str = "Ethan",
          repetition_penalty: float = 1.05) -> HFReply:
    """One text request through generate(): the thinker's reply ids, the codec frames, the waveform, the time."""
    import torch

    x = torch.tensor([prompt_ids], device=model.device)
    seen: list[np.ndarray] = []
    decode = model.code2wav.chunked_decode

    def spy(codes, *a, **k):  # the frames transformers hands to code2wav: [1, G, N]
        seen.append(codes[0].T.cpu().numpy().copy())
        return decode(codes, *a, **k)

    model.code2wav.chunked_decode = spy
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            seq, wav = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), speaker=speaker, return_audio=True,
                thinker_max_new_tokens=thinker_tokens, thinker_min_new_tokens=thinker_tokens, thinker_do_sample=False,
                talker_max_new_tokens=frames, talker_min_new_tokens=frames, talker_do_sample=False,
                talker_repetition_penalty=repetition_penalty)
        synced(model)
        seconds = time.perf_counter() - t0
    finally:
        model.code2wav.chunked_decode = decode
    codes = seen[0] if seen else np.zeros((0, 0), np.int64)
    return HFReply(seq[0, len(prompt_ids):].tolist(), codes, wav.reshape(-1).float().cpu().numpy(), seconds)


def windowed_decode(model: Any, frames: np.ndarray, first: int, chunk: int, left: int,
                    max_chunk: int | None = None) -> np.ndarray:
    """transformers' code2wav on `frames` [N, G] in the windows omni's streaming code2wav decodes: [0, first), then
    `chunk` frames doubling up to `max_chunk` (default: chunk, a fixed size), each with `left` frames of left
    context as chunked_decode's loop gives them (with first == chunk == max_chunk this is chunked_decode(chunk, left)
    itself)."""
    import torch

    c2w = model.code2wav
    spf = int(c2w.total_upsample)
    x = torch.from_numpy(np.ascontiguousarray(frames.T))[None].to(c2w.device)
    cap = chunk if max_chunk is None else max_chunk
    pieces, start, end = [], 0, min(first, len(frames))
    with torch.inference_mode():
        while start < len(frames):
            ctx = left if start - left > 0 else start  # chunked_decode's left context rule
            wav = c2w(x[..., start - ctx : end])
            pieces.append(wav[..., ctx * spf :].reshape(-1).float().cpu().numpy())
            grown = min(cap, chunk << min(len(pieces) - 1, 30))  # chunk, then doubling up to max_chunk
            start, end = end, min(end + grown, len(frames))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
