"""StageTensorCache: CPU mirrors of the KV blocks for per-token stage outputs.

A stage that hits the prefix cache computes only its new tokens, yet the next
stage needs the hidden states of the *whole* sequence. So every per-token
output is also kept in a CPU tensor laid out exactly like the KV cache:

    cache[name]: (num_blocks, block_size, *feature_shape)
    slot = block_id * block_size + offset      (the KV slot mapping, reused)

    flattened view (num_blocks * block_size, D):
      row 0..3   block 0  [ The quick brown fox ]   <- written by request A
      row 4..7   block 1  [ was tired and slept ]
      ...
    request B hits block 0: its rows are cache[name][[0]], gathered once;
    its own rows come from its forward passes; downstream gets cat(both).

Writes happen right after each forward for every computed token (prompt and
generated) and before any read in the same step, so a request that hits a
block another request filled in this very step reads valid rows.

Which outputs are cached is discovered at run time: a tensor whose first
dimension equals the number of tokens in the forward pass and whose ndim >= 2
is per-token; anything else is per-request metadata and passes through.

The engine writes and gathers it through request_rows.py (one background
queue); a GPU step's rows reach the host through rows_to_host.py.
"""
from __future__ import annotations

import torch


def is_per_token(t: object, num_tokens: int) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[0] == num_tokens


class StageTensorCache:
    def __init__(self, num_blocks: int, block_size: int, device: str | torch.device = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.caches: dict[str, torch.Tensor] = {}
        self.rows_written = 0
        self.rows_served = 0

    def _cache_for(self, name: str, t: torch.Tensor) -> torch.Tensor:
        cache = self.caches.get(name)
        if cache is None:
            # Allocated lazily on first sight, with the output's dtype and feature shape.
            cache = torch.zeros((self.num_blocks, self.block_size, *t.shape[1:]),
                                dtype=t.dtype, device=self.device)
            self.caches[name] = cache
        elif cache.shape[2:] != t.shape[1:] or cache.dtype != t.dtype:
            raise ValueError(
                f"stage output {name!r} changed shape/dtype between steps: cached "
                f"{tuple(cache.shape[2:])}/{cache.dtype}, got {tuple(t.shape[1:])}/{t.dtype}")
        return cache

    def write(self, slot_mapping: torch.Tensor, outputs: dict[str, torch.Tensor]) -> None:
        """Store the rows of every per-token output at the step's slot mapping."""
        num_tokens = slot_mapping.shape[0]
        slots = slot_mapping.to(self.device)
        for name, t in outputs.items():
            if not is_per_token(t, num_tokens):
                continue
            cache = self._cache_for(name, t)
            flat = cache.view(self.num_blocks * self.block_size, *cache.shape[2:])
            flat.index_copy_(0, slots, t.detach().to(self.device))
        self.rows_written += num_tokens

    def read(self, block_ids: list[int], num_tokens: int) -> dict[str, torch.Tensor]:
        """Rows of the first `num_tokens` tokens held by `block_ids` (a prefix hit, counted as served)."""
        out = self.gather(block_ids, num_tokens)
        self.rows_served += num_tokens if out else 0
        return out

    def gather(self, block_ids: list[int], num_tokens: int, start: int = 0) -> dict[str, torch.Tensor]:
        """Rows of tokens [start, num_tokens) held by `block_ids`, uncounted."""
        if num_tokens <= start or not self.caches:
            return {}
        first, nblk = start // self.block_size, -(-num_tokens // self.block_size)
        idx = torch.tensor(block_ids[first:nblk], dtype=torch.long, device=self.device)
        lo, hi = start - first * self.block_size, num_tokens - first * self.block_size
        out = {}
        for name, cache in self.caches.items():
            out[name] = cache.index_select(0, idx).flatten(0, 1)[lo:hi]
        return out

    @property
    def bytes_held(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.caches.values())

    def stats(self) -> dict:
        return {
            "tensor_cache_outputs": sorted(self.caches),
            "tensor_cache_bytes": self.bytes_held,
            "tensor_cache_rows_written": self.rows_written,
            "tensor_cache_rows_served": self.rows_served,
        }
