"""Shared helpers for the Qwen3-Omni stage tests: stages and transformers' model loaded once per process,
the three engines wired like stage_configs/qwen3_omni_tiny.yaml, and transformers' reference."""
from __future__ import annotations

import contextlib

import functools

import numpy as np
import torch

from omni.messages import StageInput

THINKER_MAX = 10
TALKER_MAX = 30
TALKER_SAMPLING = dict(temperature=0.0, max_tokens=TALKER_MAX, repetition_penalty=1.05)
VARIANTS = ("tiny", "k1g2")  # 4 experts top-2 with 4 code groups; 2 experts top-1 with 2 code groups
# The tiny checkpoints' decoders (stages/qwen3_omni/checkpoint.py): thinker 3 layers, widest sum 128 (its
# dense intermediate size; the experts' are 32).
THINKER_LAYERS = 3

PROMPTS = {
    "short": "Hello there, who are you?",
    "long": "Tell me a story about a cat and a dog who go on a long journey through the mountains together.",
    "turns": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Sing."}],
}


def audio(seed: int = 0, seconds: float = 1.0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(16000 * seconds))).astype(np.float32)


def cases() -> list[StageInput]:
    """The text prompts above, an audio clip with a question and an image with a question."""
    from omni.messages import MultiModalInput

    return [StageInput(name, prompt=p) for name, p in PROMPTS.items()] + [
        StageInput("audio", prompt="What do you hear?", mm_inputs=[MultiModalInput("audio", audio(0), 16000)]),
        StageInput("image", prompt="What is in this picture?", mm_inputs=[MultiModalInput("image", image(0))])]


def image(seed: int = 0, h: int = 64, w: int = 96) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@functools.lru_cache(maxsize=None)
def checkpoint(variant: str):
    from stages.qwen3_omni.checkpoint import tiny_qwen3_omni_checkpoint

    return tiny_qwen3_omni_checkpoint(variant)


@functools.lru_cache(maxsize=None)
def stages(variant: str):
    """(thinker, talker, code2wav) stage models of a tiny checkpoint, loaded through their `load`."""
    from stages.qwen3_omni.edges import Qwen3OmniCode2WavStage, Qwen3OmniTalkerStage, Qwen3OmniThinkerStage

    path, kw = checkpoint(variant), dict(dtype=torch.float32, device=torch.device("cpu"))
    return (Qwen3OmniThinkerStage.load(path, **kw), Qwen3OmniTalkerStage.load(path, **kw),
            Qwen3OmniCode2WavStage.load(path, **kw))


@functools.lru_cache(maxsize=None)
def hf_model(variant: str):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(checkpoint(variant)), dtype=torch.float32).eval()


def _hf_generate(variant: str, ids: tuple[int, ...], thinker_max: int, talker_max: int, speaker: str,
                 features: torch.Tensor | None = None, pixels: torch.Tensor | None = None,
                 grid: torch.Tensor | None = None):
    model = hf_model(variant)
    frames: list[np.ndarray] = []
    orig = model.code2wav.chunked_decode

    def spy(codes, *a, **k):  # the frames transformers hands to code2wav
        frames.append(codes[0].T.numpy().copy())
        return orig(codes, *a, **k)

    model.code2wav.chunked_decode = spy
    try:
        x = torch.tensor([list(ids)])
        kw = {} if features is None else {"input_features": features[None],
                                          "feature_attention_mask": torch.ones(1, features.shape[1], dtype=torch.long)}
        if pixels is not None:
            kw.update(pixel_values=pixels, image_grid_thw=grid[None])
        with torch.inference_mode():
            seq, wav = model.generate(input_ids=x, **kw, thinker_max_new_tokens=thinker_max, thinker_do_sample=False,
                                      talker_max_new_tokens=talker_max, talker_do_sample=False,
                                      talker_repetition_penalty=1.05, return_audio=True, speaker=speaker)
    finally:
        model.code2wav.chunked_decode = orig
    return seq[0, len(ids):].tolist(), frames[0], wav.reshape(-1).float().numpy()


_HF_RESULTS: dict[tuple, tuple[list[int], np.ndarray, np.ndarray]] = {}


def hf_generate(variant: str, ids: list[int], *, thinker_max: int = THINKER_MAX, talker_max: int = TALKER_MAX,
                speaker: str = "Ethan", features: torch.Tensor | None = None, pixels: torch.Tensor | None = None,
                grid: torch.Tensor | None = None, threads: int | None = None) -> tuple[list[int], np.ndarray, np.ndarray]:
    """transformers' Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True), greedy thinker and talker,
    with an audio clip's log-mel `features` [mel, frames] if given: (thinker tokens, the codec frames [N, G] it
    decodes, waveform). Memoized: the same request is generated once per process (and thread count).

    `threads`: torch's intra-op threads for the call (default: the caller's). A waveform is bit for bit the
    pipeline's only when both sum in the same order, i.e. on as many threads as the stages that made it
    ran on: the local backend runs its stages on its own count (omni/pipeline/threads.py)."""
    threads = threads or torch.get_num_threads()
    key = (variant, tuple(ids), thinker_max, talker_max, speaker,
           None if features is None else features.numpy().tobytes(),
           None if pixels is None else pixels.numpy().tobytes(), threads)
    if key not in _HF_RESULTS:
        with torch_threads(threads):
            _HF_RESULTS[key] = _hf_generate(variant, tuple(ids), thinker_max, talker_max, speaker, features, pixels,
                                            grid)
    return _HF_RESULTS[key]


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to `n` in this thread for the block, the caller's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hf_reference(variant: str, inp: StageInput, **kw) -> tuple[list[int], np.ndarray, np.ndarray]:
    """hf_generate on the prompt ids, audio features and pixel values our thinker builds for `inp` (at most one
    clip and one image)."""
    prepared = stages(variant)[0].preprocess(inp)
    items = prepared.extra["thinker"].items
    clips = [it for it in items if it.modality == "audio"]
    images = [it for it in items if it.modality == "image"]
    assert len(clips) <= 1 and len(images) <= 1, "the reference feeds one clip and one image"
    return hf_generate(variant, prepared.token_ids, features=clips[0].data if clips else None,
                       pixels=images[0].data if images else None, grid=images[0].grid_thw if images else None, **kw)


def hf_thinker_tokens(inp: StageInput, variant: str = "tiny") -> list[int]:
    """transformers' Qwen3OmniMoeForConditionalGeneration.generate (text out) on the ids and tensors our thinker
    builds: pixel values and grids of the images and videos, the tracks' features, use_audio_in_video."""
    prepared = stages(variant)[0].preprocess(inp)
    items = sorted(prepared.extra["thinker"].items, key=lambda i: i.offset)
    images = [i for i in items if i.modality == "image"]
    videos = [i for i in items if i.modality == "video"]
    clips = [a for i in items for a in ([i] if i.modality == "audio" else [i.audio]) if a is not None]
    kw: dict = {}
    if images:
        kw.update(pixel_values=torch.cat([i.data for i in images]),
                  image_grid_thw=torch.stack([i.grid_thw for i in images]))
    if videos:
        kw.update(pixel_values_videos=torch.cat([v.data for v in videos]),
                  video_grid_thw=torch.stack([v.grid_thw for v in videos]),
                  video_second_per_grid=torch.tensor([v.second_per_grid for v in videos]),
                  use_audio_in_video=any(v.audio is not None for v in videos))
    if clips:
        frames = max(c.data.shape[1] for c in clips)
        feats = torch.zeros(len(clips), clips[0].data.shape[0], frames)
        mask = torch.zeros(len(clips), frames, dtype=torch.long)
        for j, c in enumerate(clips):
            feats[j, :, : c.data.shape[1]], mask[j, : c.data.shape[1]] = c.data, 1
        kw.update(input_features=feats, feature_attention_mask=mask)
    x = torch.tensor([prepared.token_ids])
    with torch.inference_mode():
        seq = hf_model(variant).generate(input_ids=x, attention_mask=torch.ones_like(x), return_audio=False,
                                        thinker_max_new_tokens=THINKER_MAX, thinker_do_sample=False, **kw)
    seq = seq[0] if isinstance(seq, tuple) else seq
    return seq[0, x.shape[1]:].tolist()


def make_chain(variant: str, *, caching: bool = True, block_size: int = 4, chunk: int = 512, code2wav_kwargs=None):
    """Three engines wired like stage_configs/qwen3_omni_tiny.yaml (without the pipeline layer)."""
    from omni.engine.one_shot import OneShotEngineConfig, OneShotStageEngine
    from omni.sampling_params import SamplingParams
    from tests.engine_utils import make_engine

    thinker, talker, code2wav = stages(variant)
    t = make_engine(None, model=thinker, caching=caching, block_size=block_size, max_num_batched_tokens=chunk,
                    name="thinker", default_sampling=SamplingParams(temperature=0.0, max_tokens=THINKER_MAX))
    k = make_engine(None, model=talker, caching=caching, block_size=block_size, max_num_batched_tokens=chunk,
                    name="talker", default_sampling=SamplingParams(**TALKER_SAMPLING))
    w = OneShotStageEngine(OneShotEngineConfig("code2wav", type(code2wav), None), model=code2wav)
    return t, k, w


def run_chain(chain, inputs: list[StageInput]):
    """Run requests through thinker -> talker -> code2wav; returns {rid: (thinker, talker, code2wav) outputs}."""
    from stages.qwen3_omni.edges import talker2code2wav, thinker2talker
    from tests.stages import omni_utils

    return omni_utils.run_chain(chain, inputs, (thinker2talker, talker2code2wav))


def frames_of(talker_out, request: StageInput) -> np.ndarray:
    from stages.qwen3_omni.edges import talker2code2wav

    return talker2code2wav({"talker": talker_out}, request).payload.codes


# `device: auto` puts the pipeline's stages on a GPU where there is one, while transformers' reference runs here on
# the CPU: cuDNN's convolutions (TF32 by default) and the GPU's other kernels round differently from the CPU's, so
# there the waveforms agree to an SNR bound instead of bit for bit (an H100: 65-68 dB; a wrong frame is < 10 dB).
PIPELINE_ON_GPU = torch.cuda.is_available()
GPU_MIN_SNR_DB = 50.0


def assert_same_audio(pcm: bytes, ref: np.ndarray) -> None:
    """The pipeline's 16-bit PCM equals transformers' waveform `ref` as PCM (bit for bit on the CPU; on a GPU, the
    same length within GPU_MIN_SNR_DB)."""
    from omni.bench.measures import snr_db  # the benches' SNR (capacity, qwen3-vs-hf, token2wav)
    from omni.serve.audio.codecs import pcm16_to_float, to_pcm16

    want = to_pcm16(ref)
    if not PIPELINE_ON_GPU:
        assert pcm == want
        return
    assert len(pcm) == len(want)
    assert snr_db(pcm16_to_float(want), pcm16_to_float(pcm)) >= GPU_MIN_SNR_DB
