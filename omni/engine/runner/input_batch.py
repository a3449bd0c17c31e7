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

The pinned host buffers are written again next step only after this step's
copies have read them: `upload` records an event behind its copies and
`wait_uploaded()` (called before the host side is filled) waits on it. A step
that samples ends with a host sync anyway, but one that samples nothing (a
chunk of a long or streamed prompt) does not: without the event the next
step's `fill()` overwrote inputs the GPU had not yet copied (measured on an
H100: a prompt streamed one token a step decoded other tokens).

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
        self._uploaded = torch.cuda.Event() if on_cuda else None
        self._pending = False

    def wait_uploaded(self) -> None:
        """Block until the last `upload`'s copies have read the host buffers (free once they have)."""
        if self._pending:
            self._uploaded.synchronize()
            self._pending = False

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

    def upload(self, num_tokens: int, num_seqs: int) -> None:
        """Copy the used prefix of every host buffer to the device (non-blocking)."""
        if self.device.type != "cuda":
            return
        for name in self._TOKEN_FIELDS:
            self.dev[name][:num_tokens].copy_(self.host[name][:num_tokens], non_blocking=True)
        self.dev["query_start_loc"][: num_seqs + 1].copy_(self.host["query_start_loc"][: num_seqs + 1],
                                                          non_blocking=True)
        self.dev["seq_lens"][:num_seqs].copy_(self.host["seq_lens"][:num_seqs], non_blocking=True)
        self.dev["block_tables"][:num_seqs].copy_(self.host["block_tables"][:num_seqs], non_blocking=True)
        self._record()

    def upload_sample_rows(self, rows: list[int]) -> torch.Tensor:
        """The rows that sample this step, as an index tensor on the device."""
        k = len(rows)
        self.np["sample_idx"][:k] = rows
        if self.device.type == "cuda":
            self.dev["sample_idx"][:k].copy_(self.host["sample_idx"][:k], non_blocking=True)
            self._record()
        return self.dev["sample_idx"][:k]

    def _record(self) -> None:
        self._uploaded.record()
        self._pending = True
