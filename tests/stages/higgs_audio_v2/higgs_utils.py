"""Shared by the Higgs Audio v2 tests: the tiny checkpoints, our stage in an engine, transformers' generate."""
from __future__ import annotations

import numpy as np
import torch

from omni.messages import StageInput
from omni.sampling_params import SamplingParams
from stages.higgs_audio_v2.delay import build_delay_pattern
from stages.higgs_audio_v2.model import HiggsAudioV2Stage
from tests.engine_utils import make_engine, run_to_completion

VOICE_TEXT = "Hello there, this is how my voice sounds."


def voice_codes(num_codebooks: int, codebook: int, frames: int = 40, seed: int = 0) -> np.ndarray:
    """A reference voice's codes [K, T] (as the codec would encode a clip)."""
    return np.random.default_rng(seed).integers(0, codebook, size=(num_codebooks, frames))


def load_stage(path, voices: dict[str, np.ndarray], tmp_path) -> HiggsAudioV2Stage:
    spec = {}
    for name, codes in voices.items():
        np.save(tmp_path / f"{name}.npy", codes)
        spec[name] = {"codes": str(tmp_path / f"{name}.npy"), "text": VOICE_TEXT}
    return HiggsAudioV2Stage.load(path, dtype=torch.float32, device=torch.device("cpu"),
                                  model_kwargs={"voices": spec})


def engine_for(stage: HiggsAudioV2Stage, path, caching: bool = True, **kw):
    return make_engine(path, model=stage, caching=caching, block_size=16, num_blocks=256,
                       max_num_batched_tokens=kw.pop("max_num_batched_tokens", 512), **kw)


def run(engine, requests: list[tuple[str, str | None]], max_tokens: int = 48, prefix: str = "r", **params):
    """(text, voice) requests through the engine together -> each one's generated frames [n, K]."""
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **params})
    for i, (text, voice) in enumerate(requests):
        engine.add_request(StageInput(f"{prefix}{i}", prompt=text, sampling_params=sp,
                                      extra={"speaker": voice} if voice else {}))
    outs = run_to_completion(engine)
    result = []
    for i in range(len(requests)):
        o = outs[f"{prefix}{i}"]
        assert o.error is None, o.error
        rows = np.asarray(o.mm_outputs["audio_codes"])
        result.append((rows[rows[:, 0] >= 0].astype(np.int64), o))
    return result


def hf_frames(hf, stage: HiggsAudioV2Stage | None, text: str, voice: np.ndarray | None, max_tokens: int = 48,
              voice_name: str | None = None, prompt_ids: list[int] | None = None, min_frames: int = 0) -> np.ndarray:
    """transformers' generate on the same prompt (our stage's, or `prompt_ids`): the generated frames [n, K]."""
    cfg = hf.config
    if prompt_ids is None:
        extra = {"speaker": voice_name} if voice_name else {}
        prompt_ids = stage.prompter.prepare(StageInput("hf", prompt=text, extra=extra)).token_ids
    ids = torch.tensor([prompt_ids])
    kwargs = {}
    if voice is not None:
        fr = build_delay_pattern(voice, cfg.audio_stream_bos_id, cfg.audio_stream_eos_id)
        kwargs = dict(audio_input_ids=torch.tensor(fr)[None],
                      audio_input_ids_mask=torch.ones(1, fr.shape[0], dtype=torch.bool))
    if min_frames:
        from transformers import LogitsProcessorList

        from omni.bench.references.higgs_audio_v2 import min_frames_processor

        kwargs["logits_processor"] = LogitsProcessorList([min_frames_processor(min_frames, ids.shape[1],
                                                                                 cfg.audio_stream_eos_id)])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_tokens, **kwargs)
    return out[0, (kwargs["audio_input_ids"].shape[1] if voice is not None else 0):].numpy()
