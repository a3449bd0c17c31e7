"""CUDA graphs for decode steps: capture once per batch size, replay every step.

A decode step of a small model is a few hundred tiny kernels; launched one by
one from Python, the launches (not the GPU) set the step time. A CUDA graph
records them once and replays them with one launch. Prefill and mixed steps
(varying token counts) stay eager, as in vLLM.

    captured sizes: 1 2 4 8 16 24 32 ... max_num_seqs
    a decode step of 13 sequences -> pad to 16 -> fill the persistent input
    buffers (13 real + 3 padding sequences) -> replay graph[16] -> rows [:13]

What makes a forward pass replayable:
- every input lives in InputBatch's device buffers, whose addresses never
  change; the graph reads whatever the host uploaded before the replay;
- the attention kernels' grid depends only on (tokens, sequences), both fixed
  by the padded size, and the launcher never syncs with the host;
- padding sequences have one token, see one key and write no K/V (slot -1).

A model opts in with `StageModel.supports_cuda_graphs` (its forward must not
read per-request host state); capture failures fall back to eager with a
warning instead of failing the stage.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from omni.engine.runner.forward_context import ForwardContext, set_forward_context
from omni.engine.runner.input_batch import InputBatch

logger = logging.getLogger(__name__)

ForwardFn = Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_num_seqs (vLLM's spacing; padding costs < 8 rows)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, batch: InputBatch, sizes: list[int]):
        self.batch = batch
        self.sizes = sorted(s for s in sizes if 0 < s <= batch.max_num_seqs)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self.replays = 0

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds `num_seqs` one-token sequences, or None (run eager)."""
        for s in self.sizes:
            if s >= num_seqs and s in self._graphs:
                return s
        return None

    @torch.inference_mode()
    def capture(self, forward: ForwardFn, make_context: Callable[[int], ForwardContext]) -> None:
        """Capture one graph per size, largest first (later ones reuse its memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        batch = self.batch
        ids, pos = batch.dev["input_ids"], batch.dev["positions"]
        for size in sorted(self.sizes, reverse=True):
            batch.np["query_start_loc"][0] = 0
            batch.fill_padding(0, 0, size)  # all padding: nothing is written to the KV cache
            batch.upload(size, size)
            ctx = make_context(size)
            try:
                # Warm up on a side stream (compiles Triton kernels, creates
                # cuBLAS handles) so that the capture records only the work.
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side), set_forward_context(ctx):
                    for _ in range(2):
                        forward(ids[:size], pos[:size])
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with set_forward_context(ctx), torch.cuda.graph(graph, pool=pool):
                    out = forward(ids[:size], pos[:size])
            except Exception as exc:  # noqa: BLE001 - any capture failure means: run eager
                logger.warning("CUDA graph capture failed at batch size %d (%s: %s); decode runs eager",
                               size, type(exc).__name__, exc)
                self._graphs.clear()
                return
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def replay(self, size: int) -> dict[str, torch.Tensor]:
        """Replay the graph of `size` on the inputs already uploaded; returns its static outputs
        (overwritten by the next replay: consume or copy them first)."""
        graph, out = self._graphs[size]
        graph.replay()
        self.replays += 1
        return out
