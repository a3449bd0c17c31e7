"""Block-local DiT attention is the full block-masked attention transformers runs, without the scores it
throws away: the same outputs up to the order of fp32 sums, and provably nothing read outside a block's
window (changing those keys changes nothing, bitwise)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages.qwen2_5_omni.dit_attention import BlockLocalAttention, needs_blocks
from tests.tolerances import reorder_atol

BLOCK = 8


def _full(query, key, value, back, ahead):
    """transformers' DiT attention: a [frames, frames] block mask (DiTDecoderLayer's block_diff) and SDPA."""
    blocks = torch.arange(query.shape[1]) // BLOCK
    diff = blocks[None, :] - blocks[:, None]
    allowed = (diff >= -back) & (diff <= ahead)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=allowed[None, None])
    return out.transpose(1, 2)


def _qkv(frames, seed=0, batch=2, heads=3, dim=16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, frames, heads, dim, generator=gen) for _ in range(3)]


@pytest.mark.parametrize("frames", [1, 7, 8, 9, 24, 29, 80])
@pytest.mark.parametrize("back,ahead", [(0, 0), (1, 0), (0, 1), (1, 1), (2, 1)])
def test_equals_the_full_block_masked_attention(frames, back, ahead):
    q, k, v = _qkv(frames)
    got = BlockLocalAttention(BLOCK)(q, k, v, back, ahead)
    want = _full(q, k, v, back, ahead)
    assert got.shape == want.shape
    # three sums in sequence (scores over head_dim, the softmax denominator and probabilities @ V over the
    # attended positions), the values' scale bounding the last
    atol = reorder_atol(max(q.shape[-1], frames), float(v.abs().max()), depth=3)
    assert (got - want).abs().max().item() <= atol


@pytest.mark.parametrize("back,ahead", [(0, 0), (1, 0), (0, 1)])
def test_a_block_reads_exactly_its_window(back, ahead):
    """Block 2's output does not change, bitwise, when any key or value outside blocks 2-back .. 2+ahead
    changes; it does when one inside does."""
    frames, target = 6 * BLOCK - 3, 2
    q, k, v = _qkv(frames, seed=1)
    attention = BlockLocalAttention(BLOCK)
    base = attention(q, k, v, back, ahead)[:, target * BLOCK:(target + 1) * BLOCK]
    window = range((target - back) * BLOCK, (target + 1 + ahead) * BLOCK)
    for pos in (0, BLOCK - 1, (target - back) * BLOCK - 1, (target + 1 + ahead) * BLOCK, frames - 1):
        if pos in window or not 0 <= pos < frames:
            continue
        k2, v2 = k.clone(), v.clone()
        k2[:, pos] += 100.0
        v2[:, pos] -= 100.0
        assert torch.equal(attention(q, k2, v2, back, ahead)[:, target * BLOCK:(target + 1) * BLOCK], base), pos
    for pos in (window.start, window.stop - 1):
        v2 = v.clone()
        v2[:, pos] += 1.0
        assert not torch.equal(attention(q, k, v2, back, ahead)[:, target * BLOCK:(target + 1) * BLOCK], base), pos


def test_blocks_only_where_the_request_spans_two_blocks_more_than_a_window():
    assert not needs_blocks(8, 8, 0, 0)  # one block: its own window is everything
    assert not needs_blocks(16, 8, 0, 0) and needs_blocks(17, 8, 0, 0)  # 2 blocks: the full pass is cheaper
    assert not needs_blocks(24, 8, 1, 0) and needs_blocks(25, 8, 1, 0)
    assert not needs_blocks(32, 8, 1, 1) and needs_blocks(33, 8, 1, 1)


def test_the_guidance_rows_stay_apart():
    """Each row (the guided and the null one) attends within itself."""
    q, k, v = _qkv(3 * BLOCK + 5, seed=2)
    attention = BlockLocalAttention(BLOCK)
    both = attention(q, k, v, 1, 0)
    for row in range(2):
        alone = attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], 1, 0)
        assert torch.equal(both[row:row + 1], alone)


def test_a_long_request_builds_no_frames_squared_mask(tiny_omni):
    """A 2,048-code request (4,096 frames) keeps no [frames, frames] mask per layer kind (64 MB each in
    fp32 on the full attention's path): every layer attends block-local."""
    from stages.qwen2_5_omni.dit import DiTRequest, DiTVelocity
    from stages.qwen2_5_omni.token2wav import Qwen2_5OmniToken2WavStage

    stage = Qwen2_5OmniToken2WavStage.load(tiny_omni, dtype=torch.float32, device=torch.device("cpu"))
    dit = stage.token2wav.code2wav_dit_model
    codes = list(range(10, 10 + 2048))
    window = stage._window([c % stage.num_codes for c in codes], None, stage._noise(0, len(codes)))
    velocity = DiTVelocity(dit, [window], 0.5)
    assert velocity.masks == [[None] * len(dit.transformer_blocks)]
    with torch.inference_mode():
        out = velocity(torch.tensor(0.5), window.noise)
    assert out.shape == window.noise.shape and torch.isfinite(out).all()
