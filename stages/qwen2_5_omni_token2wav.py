"""Qwen2.5-Omni token2wav as a (non-autoregressive) stage: codec tokens -> waveform.

A DiT turns the codec tokens into a mel spectrogram by integrating an ODE from Gaussian noise
(10 Runge-Kutta steps, classifier-free guidance), and BigVGAN turns the mel into a 24 kHz
waveform. No KV cache and no prefix caching: it runs in omni.engine.generation_engine.

The noise comes from torch's global RNG (transformers' code draws it with `torch.randn`), so each
request runs under `torch.random.fork_rng` seeded with the request's seed (sampling `seed`, else 0):
the same codes and seed give the same waveform, whatever else ran before.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni.engine.stage_model import OneShotStageModel
from omni.outputs import StageInput

from .qwen2_5_omni_talker import load_speakers, speaker_params
from .qwen2_5_omni_thinker import load_omni_part


class Qwen2_5OmniToken2WavStage(OneShotStageModel):
    tokenizer = None
    eos_token_id = None
    sampling_rate = 24000

    def __init__(self, token2wav, speakers: dict, device: torch.device, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0):
        self.token2wav = token2wav
        self.speakers = speakers
        self.device = device
        self.dtype = torch.float32  # transformers runs token2wav in fp32 only
        dit = token2wav.config.dit_config
        self.num_codes = dit.num_embeds
        self.max_codes = dit.max_position_embeddings // dit.repeats
        self.vocab_size = dit.num_embeds
        self.hidden_size = dit.hidden_size
        self.max_model_len = self.max_codes
        self.kwargs = {"num_steps": num_steps, "guidance_scale": guidance_scale,
                       "sway_coefficient": sway_coefficient}

    @classmethod
    def load(cls, model_path: Path, *, dtype: torch.dtype, device: torch.device,
             model_kwargs: dict[str, Any] | None = None, tokenizer_path: Path | None = None):
        from transformers import Qwen2_5OmniToken2WavModel

        kwargs = dict(model_kwargs or {})
        gen = {k: kwargs.pop(k) for k in ("num_steps", "guidance_scale", "sway_coefficient") if k in kwargs}
        model, _ = load_omni_part(Path(model_path), "token2wav", Qwen2_5OmniToken2WavModel, torch.float32,
                                  device, **kwargs)
        return cls(model, load_speakers(Path(model_path)), device, **gen)

    def codes_of(self, inp: StageInput) -> list[int]:
        codes = [int(t) for t in (inp.prompt_token_ids or [])]
        if not codes:
            raise ValueError("prompt_token_ids: token2wav needs at least one codec token")
        bad = [c for c in codes if not 0 <= c < self.num_codes]
        if bad:
            raise ValueError(f"prompt_token_ids: codec token {bad[0]} is out of range (0..{self.num_codes - 1})")
        if len(codes) > self.max_codes:
            raise ValueError(f"prompt_token_ids: {len(codes)} codec tokens, at most {self.max_codes} allowed")
        return codes

    @torch.inference_mode()
    def generate(self, codes: list[int], speaker: str | None = None, seed: int = 0) -> np.ndarray:
        """Codec tokens -> float32 waveform [num_samples]."""
        spk = speaker_params(self.speakers, speaker)
        code = torch.tensor([codes], dtype=torch.long, device=self.device)
        cond = spk["cond"].to(self.device).float().expand(1, -1)
        ref = spk["ref_mel"].to(self.device).float().expand(1, -1, -1)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            wav = self.token2wav(code, conditioning=cond, reference_mel=ref, **self.kwargs)
        return wav.reshape(-1).float().cpu().numpy()

    # -- GenerationStageEngine hooks ------------------------------------------
    def prepare_generation(self, inp: StageInput, seed: int) -> tuple[list[int], str | None, int]:
        speaker = inp.extra.get("speaker")
        speaker_params(self.speakers, speaker)  # unknown speaker: ValueError at add time
        return self.codes_of(inp), speaker, seed

    def run_generation(self, job: tuple[list[int], str | None, int]) -> dict[str, Any]:
        codes, speaker, seed = job
        return {"audio": self.generate(codes, speaker, seed), "sampling_rate": self.sampling_rate}
