"""Per-request per-token outputs of a stage: prefix-hit rows + fresh rows.

The stage hands downstream the rows of *every* computed token of a request,
even when most came from the prefix cache:

    step 1 (is_new, hit k tokens):  cached = tensor_cache.read(block_ids, k)
    step 1..n:                      fresh += rows computed this step
    finish:                         cat(cached, *fresh)  -> numpy float32

Per step the tensor cache is written before any read, so a request that hits
a block another request filled in this very step reads valid rows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .tensor_cache import StageTensorCache, is_per_token


@dataclass(slots=True)
class _Rows:
    cached: dict[str, torch.Tensor] = field(default_factory=dict)
    fresh: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    passthrough: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class FinishedRows:
    hidden_states: np.ndarray | None
    mm_outputs: dict[str, np.ndarray]
    passthrough: dict[str, Any]


class OutputRows:
    def __init__(self, tensor_cache: StageTensorCache | None):
        self.tensor_cache = tensor_cache
        self._rows: dict[str, _Rows] = {}
        self.time_s = 0.0  # spent writing, gathering and concatenating rows

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, req_id: str) -> None:
        self._rows[req_id] = _Rows()

    def drop(self, req_id: str) -> bool:
        return self._rows.pop(req_id, None) is not None

    def collect(self, scheduled, row_ranges, outputs: dict[str, torch.Tensor],
                slot_mapping: torch.Tensor, num_tokens: int) -> None:
        """Record this step's rows; `scheduled` and `row_ranges` are in batch order."""
        t0 = time.perf_counter()
        per_token = {k: v for k, v in outputs.items() if is_per_token(v, num_tokens)}
        if self.tensor_cache is not None:
            self.tensor_cache.write(slot_mapping, per_token)  # before any read
        num_seqs = len(scheduled)
        for i, (s, (rid, start, n)) in enumerate(zip(scheduled, row_ranges)):
            rows = self._rows.get(rid)
            if rows is None:
                continue
            if s.is_new:  # first step after add or resume (preemption): rebuild from the hit
                rows.cached, rows.fresh = {}, {}
                if s.num_hit_tokens and self.tensor_cache is not None:
                    rows.cached = self.tensor_cache.read(s.block_ids, s.num_hit_tokens)
            for name, t in per_token.items():
                rows.fresh.setdefault(name, []).append(t[start : start + n].clone())
            for name, t in outputs.items():
                if name not in per_token:
                    # Per-request metadata: the request's entry when the tensor
                    # is per sequence, else the whole value.
                    per_seq = isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == num_seqs
                    rows.passthrough[name] = t[i] if per_seq else t
        self.time_s += time.perf_counter() - t0

    def finish(self, req_id: str) -> FinishedRows | None:
        rows = self._rows.pop(req_id, None)
        if rows is None:
            return None
        t0 = time.perf_counter()
        full = {}
        for name, parts in rows.fresh.items():
            cached = rows.cached.get(name)
            full[name] = torch.cat(([cached] if cached is not None else []) + parts).float().cpu().numpy()
        passthrough = {k: (v.cpu().numpy() if isinstance(v, torch.Tensor) else v)
                       for k, v in rows.passthrough.items()}
        self.time_s += time.perf_counter() - t0
        return FinishedRows(full.pop("hidden_states", None), full, passthrough)
