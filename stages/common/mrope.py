"""Multimodal rotary positions (3 axes) in a packed batch, shared by the omni thinkers and talkers."""
from __future__ import annotations

import torch


def fill_mrope_positions(pos3: torch.Tensor, row: int, start: int, end: int,
                         prompt_positions: torch.Tensor, delta: int) -> None:
    """Write one request's 3-D rotary positions for its scheduled span [start, end)
    into the packed batch's `pos3[:, row : row + end - start]`: prompt tokens take
    their precomputed (text/image/audio) positions, generated tokens continue
    text-style, shifted by the request's `delta` (as transformers' get_rope_index)."""
    num_prompt = prompt_positions.shape[1]
    stop = min(end, num_prompt)
    if start < stop:
        pos3[:, row : row + stop - start] = prompt_positions[:, start:stop]
    if end > num_prompt:
        first = max(start, num_prompt)
        pos3[:, row + first - start : row + end - start] = torch.arange(first, end) + delta
