"""InputBatch: the step's packed inputs, in buffers allocated once.

Every step the runner packs the scheduled tokens of all requests into one
varlen batch. Allocating those small tensors anew each step costs a host
allocation, a pageable H2D copy and a sync per tensor; instead:

    host (pinned on CUDA)                      device (persistent)
    input_ids   [max_tokens]    int64  ---->   input_ids   [max_tokens]
    positions   [max_tokens]    int64  ---->   positions   ...
    slot_mapping[max_tokens]    int64  ---->   slot_mapping
    query_start [max_seqs + 1]  int32  ---->   query_start_loc
    seq_lens    [max_seqs]      int32  ---->   seq_lens
    block_tables[max_seqs, max_blocks] ---->   block_tables
    sample_idx  [max_seqs]      int64  ---->   sample_idx

`fill()` writes the host side through numpy views, `upload(n_tokens, n_seqs)`
issues one non-blocking copy per buffer for the used prefix only. On CPU the
host and device buffers are the same tensors: nothing is copied.

Reusing the pinned host buffers next step is safe because every step ends
with a host sync (the sampled token ids are read back) after these copies.

CUDA graphs capture the device buffers' addresses, so they are never
reallocated; a step larger than the sizes given at construction is a bug in
the caller (the scheduler's budgets bound it) and raises.
"""
from __future__ import annotations

import numpy as np
import torch


class InputBatch:
    _TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping")

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device):
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device
        on_cuda = device.type == "cuda"
        shapes = {
            "input_ids": ((max_num_tokens,), torch.int64),
            "positions": ((max_num_tokens,), torch.int64),
            "slot_mapping": ((max_num_tokens,), torch.int64),
            "query_start_loc": ((max_num_seqs + 1,), torch.int32),
            "seq_lens": ((max_num_seqs,), torch.int32),
            "block_tables": ((max_num_seqs, max_blocks_per_seq), torch.int32),
            "sample_idx": ((max_num_seqs,), torch.int64),
        }
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in shapes.items():
            h = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
            self.host[name] = h
            self.dev[name] = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else h
        # numpy views of the host buffers: filling them is plain numpy, no torch dispatch.
        self.np = {name: t.numpy() for name, t in self.host.items()}

    def check_fits(self, num_tokens: int, num_seqs: int, max_blocks: int) -> None:
        if num_tokens > self.max_num_tokens or num_seqs > self.max_num_seqs or max_blocks > self.max_blocks_per_seq:
            raise ValueError(
                f"step of {num_tokens} tokens / {num_seqs} sequences / {max_blocks} blocks per sequence exceeds "
                f"the runner's buffers ({self.max_num_tokens} / {self.max_num_seqs} / {self.max_blocks_per_seq}): "
                "max_num_batched_tokens, max_num_seqs and max_model_len must bound every step")

    def fill_padding(self, num_tokens: int, num_seqs: int, padded_seqs: int) -> None:
        """Pad a decode batch of `num_seqs` one-token sequences to `padded_seqs`
        (a captured CUDA-graph size): each padding sequence has one token at
        position 0 that sees one key and writes nowhere (slot -1)."""
        n = self.np
        extra = padded_seqs - num_seqs
        if extra <= 0:
            return
        rows = slice(num_tokens, num_tokens + extra)
        n["input_ids"][rows] = 0
        n["positions"][rows] = 0
        n["slot_mapping"][rows] = -1
        n["query_start_loc"][num_seqs + 1 : padded_seqs + 1] = np.arange(num_tokens + 1, num_tokens + extra + 1)
        n["seq_lens"][num_seqs:padded_seqs] = 1
        # Their block-table rows keep whatever (valid) block ids an earlier step left there.

    def upload(self, num_tokens: int, num_seqs: int, num_samples: int = 0) -> None:
        """Copy the used prefix of every host buffer to the device (non-blocking)."""
        if self.device.type != "cuda":
            return
        for name in self._TOKEN_FIELDS:
            self.dev[name][:num_tokens].copy_(self.host[name][:num_tokens], non_blocking=True)
        self.dev["query_start_loc"][: num_seqs + 1].copy_(self.host["query_start_loc"][: num_seqs + 1],
                                                          non_blocking=True)
        self.dev["seq_lens"][:num_seqs].copy_(self.host["seq_lens"][:num_seqs], non_blocking=True)
        self.dev["block_tables"][:num_seqs].copy_(self.host["block_tables"][:num_seqs], non_blocking=True)
        if num_samples:
            self.dev["sample_idx"][:num_samples].copy_(self.host["sample_idx"][:num_samples], non_blocking=True)
