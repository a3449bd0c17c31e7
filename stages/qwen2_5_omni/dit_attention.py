"""The DiT's block-local attention, computed block by block instead of as a full masked attention.

Qwen2.5-Omni's DiT cuts the mel frames into blocks of `block_size` and lets each layer's queries of
block i attend only to the keys of blocks i - look_backward_block .. i + look_ahead_block (most layers:
their own block only). transformers builds that as a [frames, frames] additive mask and runs one full
attention: every score of every frame pair is computed, and all but a few blocks' worth are thrown
away. The cost and the mask grow with the square of the request's length (a 30 s reply is 3,000
frames: 9 M scores per head and layer, of which a few blocks' worth per query are used).

Here each query block attends to its window of (back + 1 + ahead) blocks only: the keys and values are
padded by `back` blocks in front and `ahead` blocks behind (plus the last block's padding), and the
window of block i is a strided view of them (no copy), so one SDPA call per guidance row takes
[blocks, heads, block_size, window] scores. Window positions outside the request (the padding) are
masked; nothing else is. The result is the same attention, summed in another order: within the bound
of a reordered fp32 sum of the attended positions (tests/stages/test_qwen2_5_omni_dit_attention.py,
with keys outside a block's window shown to have no influence at all). Where the request spans fewer
than two blocks more than a window, the full attention wastes little and is the faster call, and the
caller keeps it (dit.py: `needs_blocks`), as transformers does. `omni bench token2wav`
compares the stage with transformers' token2wav by reply length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def needs_blocks(frames: int, block_size: int, back: int, ahead: int) -> bool:
    """Whether the block-local pass is the cheaper one: the request spans at least two blocks more than a
    window. (With one more, e.g. a 2-block first streamed window against own-block layers, the full
    attention computes barely more scores and makes one SDPA call instead of one per guidance row plus
    the padding: slower block-local in a profile of the small checkpoint's first streamed window.)"""
    return -(-frames // block_size) > back + 2 + ahead


class BlockLocalAttention:
    """Block-local attention for one DiT (its block size); window masks cached by (frames, back, ahead)."""

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block = block_size
        self._masks: dict[tuple[int, int, int], torch.Tensor | None] = {}

    def _mask(self, frames: int, back: int, ahead: int, like: torch.Tensor) -> torch.Tensor | None:
        """[blocks, 1, 1, window] additive mask (0 / -inf) over each block's window: -inf on the padding
        before the first frame and after the last; None when no window reaches outside the request."""
        key = (frames, back, ahead)
        if key not in self._masks:
            bs = self.block
            blocks, width = -(-frames // bs), (back + 1 + ahead) * bs
            # frame index of each window position: block i's window starts at frame (i - back) * bs
            pos = (torch.arange(blocks, device=like.device)[:, None] - back) * bs + torch.arange(width, device=like.device)
            valid = (pos >= 0) & (pos < frames)
            self._masks[key] = None if bool(valid.all()) else torch.zeros(
                (blocks, 1, 1, width), dtype=like.dtype, device=like.device).masked_fill_(
                    ~valid[:, None, None, :], float("-inf"))
        return self._masks[key]

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, back: int, ahead: int,
                 scale: float | None = None) -> torch.Tensor:
        """query/key/value [batch, frames, heads, head_dim] -> [batch, frames, heads, head_dim]: each frame
        attends to the frames of blocks (its block - back) .. (its block + ahead) of the same row."""
        batch, frames, heads, dim = query.shape
        bs = self.block
        blocks = -(-frames // bs)
        tail = blocks * bs - frames  # the last block's padding
        width = (back + 1 + ahead) * bs
        # F.pad's pairs run from the last dimension: (head_dim), (heads), (frames). Nothing to pad (own-block
        # layers over whole blocks): each row is used in place.
        q = F.pad(query, (0, 0, 0, 0, 0, tail)) if tail else query
        pad = (0, 0, 0, 0, back * bs, tail + ahead * bs)
        k, v = (F.pad(key, pad), F.pad(value, pad)) if any(pad) else (key, value)
        mask = self._mask(frames, back, ahead, query)
        outs = []
        for row in range(batch):  # the guidance rows (the window views cannot merge them with the blocks)
            qr, kr, vr = (t[row].contiguous() for t in (q, k, v))  # no copy where the row already is
            qb = qr.view(blocks, bs, heads, dim).transpose(1, 2)  # [blocks, heads, bs, dim]
            windows = (blocks, heads, width, dim), (bs * heads * dim, dim, heads * dim, 1)
            out = F.scaled_dot_product_attention(qb, kr.as_strided(*windows), vr.as_strided(*windows),
                                                 attn_mask=mask, scale=scale)
            outs.append(out.transpose(1, 2).reshape(blocks * bs, heads, dim)[:frames])
        return torch.stack(outs)
