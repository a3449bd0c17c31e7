"""RowStager: a step's per-token outputs, copied to host memory off the critical path.

The stage tensor cache (tensor_cache.py) and the rows handed downstream
(request_rows.py) live on the host, but a GPU forward pass leaves its hidden
states on the device. Copying them with `.cpu()` would stall the step on a
synchronous device-to-host copy. Instead:

    main stream:  forward k ──► logits/sample k ──► (host sync: token ids) ──► forward k+1
                        │ event                                              ▲ waits copy k
    side stream:        └──► D2H copy k into pinned buffer (k % 2) ──► event ┘
    host worker:                         waits copy k, writes tensor cache, releases buffer

- The copy runs on its own stream, overlapping logits, sampling and the next
  step's input preparation.
- Pinned buffers are double-buffered: step k+2 reuses step k's buffer only after
  the consumer released it (`StagedRows.release`).
- The next forward waits (on the GPU, not the host) for the previous copy:
  CUDA-graph outputs are static buffers that the next replay overwrites.
- Eager outputs are marked as used by the side stream (`record_stream`), so the
  caching allocator does not hand their memory out before the copy ran.

On CPU the outputs already are host tensors: staging is a no-op.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

_RELEASE_TIMEOUT_S = 60.0


@dataclass(slots=True)
class _Buffer:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    released: threading.Event = field(default_factory=threading.Event)
    copied: "torch.cuda.Event | None" = None

    def __post_init__(self) -> None:
        self.released.set()


@dataclass(slots=True)
class StagedRows:
    """Host rows of one step: `wait()` them before reading, `release()` after."""

    rows: dict[str, torch.Tensor]
    _buffer: _Buffer | None = None

    def wait(self) -> dict[str, torch.Tensor]:
        if self._buffer is not None and self._buffer.copied is not None:
            self._buffer.copied.synchronize()
        return self.rows

    def release(self) -> None:
        if self._buffer is not None:
            self._buffer.released.set()


class RowStager:
    def __init__(self, device: torch.device, max_num_tokens: int, num_buffers: int = 2):
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.on_cuda = device.type == "cuda"
        self._buffers = [_Buffer() for _ in range(num_buffers)] if self.on_cuda else []
        self._next = 0
        self._stream = torch.cuda.Stream(device) if self.on_cuda else None
        self._last_copy: torch.cuda.Event | None = None
        self.bytes_staged = 0

    def before_forward(self) -> None:
        """Make the main stream wait (GPU-side) for the previous step's copy."""
        if self._last_copy is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_copy)

    def stage(self, outputs: dict[str, torch.Tensor]) -> StagedRows:
        """Start copying `outputs` (per-token tensors, [T, ...] each) to host memory."""
        if not self.on_cuda or not outputs:
            return StagedRows(outputs)
        buf = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        if not buf.released.wait(_RELEASE_TIMEOUT_S):
            raise RuntimeError(f"staged output rows were not released within {_RELEASE_TIMEOUT_S:.0f} s")
        buf.released.clear()
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        rows = {}
        with torch.cuda.stream(self._stream):
            for name, t in outputs.items():
                t.record_stream(self._stream)
                # Rows leave the stage as float32 numpy: widen on the GPU (free)
                # rather than in a host pass over every row at delivery.
                src = t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
                host = buf.tensors.get(name)
                if host is None or host.shape[1:] != src.shape[1:] or host.dtype != src.dtype:
                    host = torch.empty((self.max_num_tokens, *src.shape[1:]), dtype=src.dtype, pin_memory=True)
                    buf.tensors[name] = host
                n = src.shape[0]
                host[:n].copy_(src, non_blocking=True)
                rows[name] = host[:n]
                self.bytes_staged += src.numel() * src.element_size()
            if buf.copied is None:
                buf.copied = torch.cuda.Event()
            buf.copied.record(self._stream)
        self._last_copy = buf.copied
        return StagedRows(rows, buf)
