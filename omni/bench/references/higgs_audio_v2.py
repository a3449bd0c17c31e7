"""transformers' Higgs Audio v2 as a user without omni runs it: `HiggsAudioV2ForConditionalGeneration.generate`,
greedy, one request after another (the reference of `omni bench tts`), each reply's frames then decoded to a
waveform.

transformers' audio tokenizer (`HiggsAudioV2TokenizerModel`) imports torchaudio, which does not load beside this
torch, so the frames are decoded by the pipeline's own codec stage (the same weights, `decoder`: engine_loop's
engine of the config's codec stage, fed through the config's input processor as omni's frames are): what differs
from omni is the LLM's loop, not the decoder. The prompt ids are omni's (`Omni.tokenize` with the voice), and the
voice's frames are laid out by transformers' own `HiggsAudioV2Processor.build_delay_pattern`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from omni.bench.references.qwen2_5_omni import load_on


@dataclass(slots=True)
class HFReply:
    frames: np.ndarray  # [n, K] generated frames (delay pattern)
    audio: np.ndarray  # float32 waveform
    generate_s: float
    decode_s: float


def load(path: Any, device: str = "cpu") -> Any:
    from transformers import HiggsAudioV2ForConditionalGeneration

    return load_on(HiggsAudioV2ForConditionalGeneration, path, device)


def voice_frames(model: Any, codes: np.ndarray) -> np.ndarray:
    """A voice's codes [K, T] -> the model frames [T + K + 1, K] as HiggsAudioV2Processor lays them out."""
    import torch
    from transformers import HiggsAudioV2Processor

    cfg = model.config
    bos = np.full((codes.shape[0], 1), cfg.audio_stream_bos_id)
    eos = np.full((codes.shape[0], 1), cfg.audio_stream_eos_id)
    full = torch.tensor(np.concatenate([bos, codes, eos], axis=1))[None]
    me = SimpleNamespace(audio_stream_bos_id=cfg.audio_stream_bos_id, audio_stream_eos_id=cfg.audio_stream_eos_id)
    return HiggsAudioV2Processor.build_delay_pattern(me, full)[0].T.numpy()


def min_frames_processor(frames: int, prompt_len: int, stream_eos: int) -> Any:
    """A logits processor for `generate`: every codebook's stream-eos masked at the first `frames` steps (any one's
    would start the reply's end: what omni's stage does for `min_tokens`; transformers' Higgs generation has no
    minimum of its own). Higgs' generate takes only processors that read scores alone (its
    `_supported_logits_processor_types`); this one reads no more than the step's index, so it is declared one of
    them (InfNanRemoveLogitsProcessor's type, its own __call__). It runs after the delay pattern's processor, on the
    per-codebook [batch x K, codebook] scores."""
    from transformers import InfNanRemoveLogitsProcessor

    class MinFrames(InfNanRemoveLogitsProcessor):
        def __init__(self):
            self.frames, self.prompt_len, self.stream_eos = frames, prompt_len, stream_eos

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if input_ids.shape[1] - self.prompt_len < self.frames:
                scores = scores.clone()
                scores.view(input_ids.shape[0], -1, scores.shape[-1])[:, :, self.stream_eos] = float("-inf")
            return scores

    return MinFrames()


def generate(model: Any, prompt_ids: list[int], voice: np.ndarray | None, max_frames: int,
             min_frames: int = 0) -> tuple[np.ndarray, float]:
    """One request through generate(): its frames [n, K] and the wall time (no codebook ending before
    `min_frames` frames: min_frames_processor)."""
    import torch
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt_ids], device=model.device)
    kwargs: dict[str, Any] = {}
    if voice is not None:
        fr = torch.tensor(voice_frames(model, voice), device=model.device)[None]
        kwargs = {"audio_input_ids": fr, "audio_input_ids_mask": torch.ones(fr.shape[:2], dtype=torch.bool,
                                                                           device=model.device)}
    if min_frames:
        kwargs["logits_processor"] = LogitsProcessorList([min_frames_processor(min_frames, ids.shape[1],
                                                                               model.config.audio_stream_eos_id)])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_frames, **kwargs)
    seconds = time.perf_counter() - t0
    skip = fr.shape[1] if voice is not None else 0
    return out[0, skip:].cpu().numpy(), seconds


class Decoder:
    """The config's codec stage alone (engine_loop.engine), fed frames through the config's input processor."""

    def __init__(self, codec_stage: Any, upstream: str):
        from omni.bench.engine_loop import engine
        from omni.registry import resolve_input_processor

        kw = codec_stage.model_dump(exclude={"name", "model", "model_path", "inputs", "input_processor",
                                             "final_output", "replicas", "resources"}, exclude_none=True)
        self.engine = engine(codec_stage.name, codec_stage.model, codec_stage.model_path, **kw)
        self.processor = resolve_input_processor(codec_stage.input_processor)
        self.upstream = upstream
        self._n = 0

    def decode(self, frames: np.ndarray) -> tuple[np.ndarray, float]:
        from omni.bench.engine_loop import run
        from omni.messages import StageInput, StageOutput

        self._n += 1
        rid = f"hf{self._n}"
        out = StageOutput(rid, self.upstream, mm_outputs={"audio_codes": frames.astype(np.float32)})
        t0 = time.perf_counter()
        inp = self.processor({self.upstream: out}, StageInput(rid))
        (wav,) = run(self.engine, [inp])
        if wav.error is not None:
            raise RuntimeError(f"decoding transformers' frames failed: {wav.error}")
        return np.asarray(wav.audio, dtype=np.float32), time.perf_counter() - t0

    def close(self) -> None:
        self.engine.close()


def reply(model: Any, decoder: Decoder, prompt_ids: list[int], voice: np.ndarray | None, max_frames: int,
          min_frames: int = 0) -> HFReply:
    frames, gen_s = generate(model, prompt_ids, voice, max_frames, min_frames)
    # HiggsAudioV2Processor.batch_decode's cut: the frames from the sequence's last all-stream-bos frame (the
    # generation's start; any audio of the prompt's before it is not the reply)
    starts = np.flatnonzero((frames == model.config.audio_stream_bos_id).all(axis=1))
    frames = frames[starts[-1]:] if len(starts) else frames
    audio, dec_s = decoder.decode(frames)
    return HFReply(frames, audio, gen_s, dec_s)
