"""The DiT sampler with the request's constants hoisted gives transformers' own results: bitwise while every
layer attends to the whole request, within a reordered-sum bound once attention runs block-local."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.qwen2_5_omni.dit import DiTRequest, DiTVelocity
from tests.stages.omni_utils import mel_atol, velocity_atol, wave_atol
from stages.qwen2_5_omni.talker import speaker_params
from stages.qwen2_5_omni.token2wav import Qwen2_5OmniToken2WavStage


@pytest.fixture(scope="module", params=["tiny", "small"])
def stage(request, tiny_omni):
    from stages.qwen2_5_omni.checkpoint import small_omni_checkpoint

    path = tiny_omni if request.param == "tiny" else small_omni_checkpoint()
    return Qwen2_5OmniToken2WavStage.load(path, dtype=torch.float32, device=torch.device("cpu"))


def _speaker(stage, name):
    spk = speaker_params(stage.speakers, name)
    return spk["cond"].float().expand(1, -1), spk["ref_mel"].float().expand(1, -1, -1)


def _layer_windows(dit) -> set[tuple[int, int]]:
    return {(layer.look_backward_block, layer.look_ahead_block) for layer in dit.transformer_blocks}


def _takes_blocks(dit, num_codes: int) -> bool:
    """Whether some layer runs block-local attention for a request of `num_codes` codes."""
    from stages.qwen2_5_omni.dit_attention import needs_blocks

    frames = num_codes * dit.repeats
    return any(needs_blocks(frames, dit.block_size, b, a) for b, a in _layer_windows(dit))


# 11 codes: 22 frames, inside one DiT block (every layer attends to the whole request: the full
# attention, bitwise transformers'); 37: 74 frames over 4 blocks, not a multiple of the block
# (block-local attention, a padded last block).
@pytest.mark.parametrize("num_codes", [11, 37])
@pytest.mark.parametrize("guidance_scale", [0.5, 0.0])
def test_velocity_equals_the_dit_forward(stage, guidance_scale, num_codes):
    """One ODE evaluation, guided and plain, equals transformers' DiT forward: exactly while every layer
    sees the whole request, within the bound of reordered fp32 sums once attention runs block by block."""
    dit = stage.token2wav.code2wav_dit_model
    assert _takes_blocks(dit, num_codes) == (num_codes == 37)
    cond, ref = _speaker(stage, None)
    gen = torch.Generator().manual_seed(1)
    code = torch.randint(0, stage.num_codes, (1, num_codes), generator=gen)
    frames = code.shape[1] * dit.repeats
    x = torch.randn(1, frames, dit.mel_dim, generator=gen)
    speaker = cond.unsqueeze(1).repeat(1, frames, 1)
    velocity = DiTVelocity(dit, [DiTRequest(cond, ref, code, x)], guidance_scale)
    with torch.inference_mode():
        for t in (torch.tensor(0.0), torch.tensor(0.37), torch.tensor(1.0)):
            got = velocity(t, x)
            got = velocity(t, x)
            if guidance_scale:
                out = dit(hidden_states=x, quantized_code=code, speaker_embedding=speaker, condition_vector=ref,
                          time_step=t, apply_cfg=True)
                guided, null = torch.chunk(out, 2, dim=0)
                want = guided + (guided - null) * guidance_scale
            else:
                want = dit(hidden_states=x, speaker_embedding=speaker, condition_vector=ref, quantized_code=code,
                           time_step=t, drop_audio_conditioning=False, drop_code=False, apply_cfg=False)
            if num_codes == 11:
                assert torch.equal(got, want)
            else:
                diff, atol = (got - want).abs().max().item(), velocity_atol(stage, want)
                assert diff <= atol, f"t={t.item()}: max |diff| {diff:.3g} > {atol:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("num_codes,seed,speaker", [(1, 0, None), (12, 0, None), (40, 7, "Ethan"), (160, 3, None)])
def test_waveform_equals_transformers_token2wav(stage, num_codes, seed, speaker):
    """The stage's waveform is transformers' Qwen2_5OmniToken2WavModel.forward under the same seed: bitwise
    for a request of up to two DiT blocks, within the bound of reordered fp32 sums (omni_utils.wave_atol)
    for longer ones, whose attention runs block-local (dit_attention.py)."""
    if speaker not in (None, *stage.speakers):
        speaker = None
    codes = np.random.default_rng(num_codes).integers(0, stage.num_codes, num_codes).tolist()
    got = stage.generate(codes, speaker, seed)
    cond, ref = _speaker(stage, speaker)
    with torch.inference_mode(), torch.random.fork_rng():
        torch.manual_seed(seed)
        want = stage.token2wav(torch.tensor([codes]), conditioning=cond, reference_mel=ref, **stage.kwargs)
    want = want.reshape(-1).float().numpy()
    assert got.dtype == np.float32 and got.shape == want.shape and got.size > 0
    if not _takes_blocks(stage.token2wav.code2wav_dit_model, num_codes):
        np.testing.assert_array_equal(got, want)
    else:
        diff, atol = float(np.abs(got - want).max()), wave_atol(stage, want, num_codes * stage.repeats)
        assert diff <= atol, f"max |diff| {diff:.3g} > {atol:.3g}"


def test_noise_of_the_wrong_length_is_refused(stage):
    from stages.qwen2_5_omni.dit import dit_sample

    dit = stage.token2wav.code2wav_dit_model
    cond, ref = _speaker(stage, None)
    with pytest.raises(ValueError, match="noise has 3 frames"):
        dit_sample(dit, cond, ref, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dit.mel_dim))


@pytest.mark.parametrize("guidance_scale", [0.5, 0.0])
def test_requests_in_lockstep_give_each_ones_mel(stage, guidance_scale):
    """Requests of different lengths (one shorter than a DiT block, one not a multiple of it), speakers and
    seeds integrated together, packed along time, give the mel each gives alone: the same per-row ops,
    attention per request. Bitwise where a matrix product's row does not depend on the number of rows
    (measured with MKL: all of them but the 1-code request on the tiny checkpoint without guidance,
    whose 2 rows alone take MKL's small-matrix path: 6e-8 apart); in any case within the bound of a
    reordered fp32 chain (omni_utils.mel_atol), which is below what a swapped or mixed-up request makes
    (asserted). Machine-independent: which kernel a shape takes is the BLAS's choice; the bound holds for any."""
    from stages.qwen2_5_omni.dit import dit_sample_batch

    dit = stage.token2wav.code2wav_dit_model
    rng = np.random.default_rng(5)
    speakers = [*stage.speakers, None]
    lengths = (37, 1, 24, 37)
    windows = [stage._window(rng.integers(0, stage.num_codes, n).tolist(), speakers[i % len(speakers)],
                             stage._noise(i, n)) for i, n in enumerate(lengths)]
    kw = {**stage.kwargs, "guidance_scale": guidance_scale, "num_steps": 4}  # 12 evaluations: the same ops
    with torch.inference_mode():
        alone = [dit_sample_batch(dit, [w], **kw)[0] for w in windows]
        together = dit_sample_batch(dit, windows, **kw)
    assert [m.shape[-1] for m in together] == [n * dit.repeats for n in lengths]
    for i, (a, b) in enumerate(zip(alone, together)):
        atol = mel_atol(stage, a, kw["num_steps"])
        diff = (a - b).abs().max().item()
        assert diff <= atol, f"request {i}: max |diff| {diff:.3g} > {atol:.3g}"
    # Two requests of one length: a swap (or attention across them) would be far outside the bound.
    assert (alone[0] - alone[3]).abs().max().item() > 10 * mel_atol(stage, alone[0], kw["num_steps"])


def test_batch_cap_splits_calls_in_order():
    from stages.qwen2_5_omni.dit import DiTRequest
    from stages.qwen2_5_omni.token2wav import _batches

    def w(n):
        return DiTRequest(torch.zeros(1, 1), torch.zeros(1, 1, 1), torch.zeros(1, n, dtype=torch.long),
                          torch.zeros(1, n, 1))

    sizes = [10, 10, 10, 40, 5]
    got = [[x.code.shape[1] for x in b] for b in _batches([w(n) for n in sizes], 25)]
    assert got == [[10, 10], [10], [40], [5]]  # the 40 alone: longer than the cap
    assert [[x.code.shape[1] for x in b] for b in _batches([w(n) for n in sizes], None)] == [sizes]
