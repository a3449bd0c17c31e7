"""Shared helpers for the Qwen2.5-Omni stage tests: inputs, transformers references."""
from __future__ import annotations

import numpy as np
import torch

from omni.messages import MultiModalInput, StageInput
from tests.tolerances import SUMS_PER_DECODER_LAYER, decoder_atol, reorder_atol

THINKER_MAX = 8
TALKER_MAX = 24

# The tiny checkpoint's decoders (stages/qwen2_5_omni/checkpoint.py tiny_omni_config): thinker 3 layers,
# hidden 64, intermediate 128; talker 2 layers, hidden 32, intermediate 64.
THINKER_LAYERS, TALKER_LAYERS = 3, 2


def thinker_atol(ref) -> float:
    """Two ways of computing the thinker's hidden states (cached vs recomputed rows, ours vs
    transformers) differ only in how fp32 sums are blocked: the decoder bound, longest sum 128 terms
    or the rows attended."""
    return decoder_atol(ref, layers=THINKER_LAYERS, widest_sum=max(128, len(ref)))


def talker_atol(ref) -> float:
    """The talker's prompt embeddings are the thinker's hidden states: both decoders' rounding."""
    return decoder_atol(ref, layers=THINKER_LAYERS + TALKER_LAYERS, widest_sum=max(128, len(ref)))


def _dit_chain(stage, frames: int, num_steps: int | None = None, evaluations: int | None = None) -> tuple[int, int]:
    """(longest sum, sums in sequence) from the ODE's initial state to the mel: 4 DiT evaluations per
    Runge-Kutta step (transformers' RungeKutta4ODESolver), or `evaluations`, each its decoder layers' sums
    plus the input and output projections; the longest sum is the input projection's, the MLP's or an
    attention row."""
    dit = stage.token2wav.code2wav_dit_model
    if evaluations is None:
        evaluations = 4 * ((num_steps or stage.kwargs["num_steps"]) - 1)
    depth = evaluations * (len(dit.transformer_blocks) * SUMS_PER_DECODER_LAYER + 2)
    longest = max(dit.input_embed.proj.in_features, dit.transformer_blocks[0].ff.ff[3].in_features, frames)
    return longest, depth


def mel_atol(stage, ref, num_steps: int | None = None) -> float:
    """Two computations of one request's mel that differ only in how fp32 sums are blocked (alone vs
    packed with other requests: a matrix product over more rows may take another kernel), relative to
    the mel's largest value as in the streaming test."""
    ref = np.asarray(ref)
    longest, depth = _dit_chain(stage, ref.shape[-1], num_steps)
    return reorder_atol(longest, float(np.abs(ref).max()), depth=depth)


def velocity_atol(stage, ref) -> float:
    """One DiT evaluation (the ODE's velocity) computed two ways that differ only in how its fp32 sums are
    blocked (block-local vs full masked attention), relative to the velocity's largest value."""
    ref = np.asarray(ref)
    longest, depth = _dit_chain(stage, ref.shape[-2], evaluations=1)
    return reorder_atol(longest, float(np.abs(ref).max()), depth=depth)


def wave_atol(stage, ref, frames: int) -> float:
    """mel_atol's chain followed by BigVGAN: every convolution (counted as if in sequence: an upper
    bound) and the two filters of each anti-aliased activation."""
    from torch import nn

    bigvgan = stage.token2wav.code2wav_bigvgan_model
    convs = [m for m in bigvgan.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    filters = 2 * sum(type(m).__name__.endswith("AntiAliasedActivation1d") for m in bigvgan.modules())
    longest, depth = _dit_chain(stage, frames)
    longest = max([longest] + [m.in_channels * m.kernel_size[0] for m in convs])
    return reorder_atol(longest, float(np.abs(np.asarray(ref)).max()), depth=depth + len(convs) + filters)


def image(seed: int = 0, h: int = 56, w: int = 84) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def audio(seed: int = 0, seconds: float = 1.0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(16000 * seconds))).astype(np.float32)


CASES = {
    "text": ("Hello there, who are you?", []),
    "image": ("What is in this picture?", [MultiModalInput("image", image(0))]),
    "audio": ("What do you hear?", [MultiModalInput("audio", audio(0), 16000)]),
}


def hf_inputs(stage, inp: StageInput) -> tuple[list[int], dict]:
    """The prompt ids our thinker builds + the tensors transformers' generate takes for them."""
    prepared = stage.preprocess(inp)
    items = sorted(prepared.extra["thinker"].items, key=lambda i: i.offset)  # prompt order
    kw: dict = {}
    images = [i for i in items if i.modality == "image"]
    videos = [i for i in items if i.modality == "video"]
    # a video's audio track is an audio input of transformers' where the video is (the processor's order)
    audios = [a for i in items for a in ([i] if i.modality == "audio" else [i.audio]) if a is not None]
    if images:
        kw["pixel_values"] = torch.cat([i.data for i in images])
        kw["image_grid_thw"] = torch.stack([i.grid_thw for i in images])
    if videos:
        kw["pixel_values_videos"] = torch.cat([i.data for i in videos])
        kw["video_grid_thw"] = torch.stack([i.grid_thw for i in videos])
        kw["video_second_per_grid"] = torch.tensor([i.second_per_grid for i in videos])
        kw["use_audio_in_video"] = any(i.audio is not None for i in videos)
    if audios:
        frames = max(i.data.shape[1] for i in audios)
        feats = torch.zeros(len(audios), audios[0].data.shape[0], frames)
        mask = torch.zeros(len(audios), frames, dtype=torch.long)
        for j, i in enumerate(audios):
            feats[j, :, : i.data.shape[1]] = i.data
            mask[j, : i.data.shape[1]] = 1
        kw["input_features"], kw["feature_attention_mask"] = feats, mask
    return prepared.token_ids, kw


def hf_generate(model, ids: list[int], kw: dict, *, audio_out: bool, thinker_max=THINKER_MAX,
                talker_max=TALKER_MAX, seed: int = 0, speaker: str = "Chelsie"):
    """transformers' Qwen2_5OmniForConditionalGeneration.generate, greedy thinker and talker.

    Returns (thinker tokens, talker codes or None, waveform or None)."""
    x = torch.tensor([ids])
    common = dict(input_ids=x, attention_mask=torch.ones_like(x), thinker_max_new_tokens=thinker_max,
                  thinker_do_sample=False, speaker=speaker, **kw)
    with torch.inference_mode():
        if not audio_out:
            seq = model.generate(generation_mode="text", **common)
            return seq[0, len(ids):].tolist(), None, None
        codes: list[list[int]] = []
        orig = model.token2wav.forward

        def spy(code, *a, **k):  # record the codes transformers hands to token2wav
            codes.append(code[0].tolist())
            return orig(code, *a, **k)

        model.token2wav.forward = spy
        try:
            if "pixel_values" in kw:  # transformers forwards pixel_values to the talker, which rejects them
                common["talker_pixel_values"] = None
            torch.manual_seed(seed)
            seq, wav = model.generate(talker_do_sample=False, talker_max_new_tokens=talker_max,
                                      talker_repetition_penalty=1.05, **common)
        finally:
            model.token2wav.forward = orig
        return seq[0, len(ids):].tolist(), codes[0], wav.float().numpy()


TALKER_SAMPLING = dict(temperature=0.0, max_tokens=TALKER_MAX, repetition_penalty=1.05, stop_token_ids=[8292])


def make_chain(thinker, talker, token2wav, *, caching=True, block_size=4, chunk=512):
    """Three engines wired like stage_configs/qwen2_5_omni_tiny.yaml (without the pipeline layer)."""
    from omni.engine.one_shot import OneShotEngineConfig, OneShotStageEngine
    from omni.sampling_params import SamplingParams
    from tests.engine_utils import make_engine

    t = make_engine(None, model=thinker, caching=caching, block_size=block_size, max_num_batched_tokens=chunk,
                    name="thinker", default_sampling=SamplingParams(temperature=0.0, max_tokens=THINKER_MAX))
    k = make_engine(None, model=talker, caching=caching, block_size=block_size, max_num_batched_tokens=chunk,
                    name="talker", default_sampling=SamplingParams(**TALKER_SAMPLING))
    w = OneShotStageEngine(OneShotEngineConfig("token2wav", type(token2wav), None), model=token2wav)
    return t, k, w


def run_chain(chain, inputs: list[StageInput], processors=None):
    """Run requests through thinker -> talker -> the audio stage; returns {rid: (thinker, talker, audio) outputs}.
    `processors`: (thinker -> talker, talker -> audio) input processors (default: Qwen2.5-Omni's)."""
    from tests.engine_utils import run_to_completion

    if processors is None:
        from stages.qwen2_5_omni.edges import talker2wav, thinker2talker

        processors = (thinker2talker, talker2wav)
    to_talker, to_audio = processors
    t, k, w = chain
    for inp in inputs:
        t.add_request(inp)
    t_out = run_to_completion(t)
    by_id = {inp.request_id: inp for inp in inputs}
    for rid, o in t_out.items():
        k.add_request(to_talker({"thinker": o}, by_id[rid]))
    k_out = run_to_completion(k)
    for rid, o in k_out.items():
        w.add_request(to_audio({"talker": o}, by_id[rid]))
    w_out = {}
    while w.has_unfinished():
        for o in w.step().finished:
            w_out[o.request_id] = o
    return {rid: (t_out[rid], k_out[rid], w_out[rid]) for rid in by_id}
