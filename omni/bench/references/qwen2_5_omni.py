"""transformers' Qwen2.5-Omni as a user without omni runs it: `Qwen2_5OmniForConditionalGeneration.generate`
with audio out, greedy thinker and talker, one request after another (the reference of `omni bench capacity`).

Fixed-length replies as omni's bench asks for them: `thinker_min_new_tokens` / `talker_min_new_tokens` equal
the maximums (transformers' MinNewTokensLogitsProcessor masks the eos ids as omni's `min_tokens` does). The
codec tokens handed to token2wav are recorded (a wrapper around its forward) to compare them with omni's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SAMPLE_RATE = 24000  # Qwen2.5-Omni's token2wav


@dataclass(slots=True)
class HFReply:
    thinker_ids: list[int]
    codes: list[int]
    audio: np.ndarray  # float32 waveform at SAMPLE_RATE
    seconds: float  # wall time of generate()

    @property
    def audio_s(self) -> float:
        return len(self.audio) / SAMPLE_RATE


def load(path: str | Path, device: str = "cpu") -> Any:
    from transformers import Qwen2_5OmniForConditionalGeneration

    return load_on(Qwen2_5OmniForConditionalGeneration, path, device)


def load_on(cls: Any, path: str | Path, device: str) -> Any:
    """transformers' model `cls` in fp32 on `device` (the benches pass the device the pipeline's thinker runs on,
    so that both sides of a comparison run on the same hardware)."""
    import torch

    return cls.from_pretrained(str(path), dtype=torch.float32).to(device).eval()


def synced(model: Any) -> None:
    """Wait for the device's queued work: a CUDA generate() may return before its last kernels ran."""
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def reply(model: Any, prompt_ids: list[int], thinker_tokens: int, codes: int, *, seed: int = 0,
          speaker: str = "Chelsie", repetition_penalty: float = 1.05) -> HFReply:
    """One request through generate(): the thinker's reply ids, the codec tokens, the waveform, the time."""
    import torch

    x = torch.tensor([prompt_ids], device=model.device)
    seen: list[list[int]] = []
    forward = model.token2wav.forward

    def spy(code, *a, **k):  # the codes transformers hands to token2wav
        seen.append(code[0].tolist())
        return forward(code, *a, **k)

    model.token2wav.forward = spy
    try:
        torch.manual_seed(seed)  # token2wav's ODE starts from noise drawn here (omni's stage: its seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            seq, wav = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), speaker=speaker,
                thinker_max_new_tokens=thinker_tokens, thinker_min_new_tokens=thinker_tokens, thinker_do_sample=False,
                talker_max_new_tokens=codes, talker_min_new_tokens=codes, talker_do_sample=False,
                talker_repetition_penalty=repetition_penalty)
        synced(model)
        seconds = time.perf_counter() - t0
    finally:
        model.token2wav.forward = forward
    return HFReply(seq[0, len(prompt_ids):].tolist(), seen[0] if seen else [], wav.float().cpu().numpy(), seconds)
