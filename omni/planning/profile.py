"""The measured part of a plan: one profile step per stage, as vLLM's profile run.

The stage's engine is built as the pipeline builds it (omni.pipeline.engine_factory), with just the
blocks the profile needs, and given a batch at its limits: max_num_seqs prompts that together fill
max_num_batched_tokens (an autoregressive stage: one step prefills them all and samples each), or
max_num_seqs requests of the longest input the stage gets (a one-shot stage: its working memory at
its batch size). What the step allocates above what existed before it is the stage's activation peak:

    CPU   the process's peak resident set during the step (VmHWM, reset through /proc/self/clear_refs
          just before, after malloc_trim has handed freed heap back to the OS so that reused free
          memory cannot hide an allocation) minus the resident set before. torch allocates host
          tensors with malloc, not through Python, so tracemalloc would not see them, and torch keeps
          no allocator statistics for the CPU; the resident set is what the machine really gives, and
          what the soak test bounds.
    CUDA  torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats, minus
          memory_allocated before (the caching allocator's own count); plus what building the engine
          allocated beyond the weights and the KV cache (input buffers, the CUDA graphs' pools: decode
          steps are captured while the engine is built).

A warm-up request of a few tokens runs first (code pages and one-time buffers are not the batch's).
The tensor cache the step fills is not an activation: its bytes are taken off, and its tensors say
which per-token outputs the stage emits and how wide they are (hidden states, and whatever the model
returns per token: a thinker's rotary positions), which prices a block of the tensor cache.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from omni.config.schema import PipelineConfig, StageConfig
from omni.messages import StageInput
from omni.pipeline.graph import StageGraph

from omni.planning.profile_store import ProfileRecord, ProfileStore, profile_key

logger = logging.getLogger(__name__)


class PeakMeter(Protocol):
    name: str

    def start(self) -> None: ...

    def peak(self) -> int:
        """Bytes allocated above the level at start(), at the highest point since."""
        ...


def _status_bytes(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    if m is None:
        raise OSError(f"/proc/self/status has no {field}")
    return int(m.group(1)) * 1024


class HostPeakMeter:
    """Peak resident set of this process (Linux)."""

    name = "peak RSS (VmHWM)"

    def __init__(self) -> None:
        self._base = 0

    @staticmethod
    def available() -> bool:
        try:
            _status_bytes("VmHWM")
            return Path("/proc/self/clear_refs").exists()
        except OSError:
            return False

    def start(self) -> None:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: freed memory may be reused unseen (the peak is then a lower bound)
        self._base = _status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def peak(self) -> int:
        return max(0, _status_bytes("VmHWM") - self._base)


class CudaPeakMeter:
    """torch.cuda's allocator counts; `cuda` is the torch.cuda module (a fake in tests)."""

    name = "torch.cuda.max_memory_allocated"

    def __init__(self, device: Any, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self.cuda, self.device, self._base = cuda, device, 0

    def start(self) -> None:
        self.cuda.synchronize(self.device)
        self.cuda.reset_peak_memory_stats(self.device)
        self._base = int(self.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        self.cuda.synchronize(self.device)
        return max(0, int(self.cuda.max_memory_allocated(self.device)) - self._base)

    def allocated(self) -> int:
        self.cuda.synchronize(self.device)
        return int(self.cuda.memory_allocated(self.device))


def meter_for(device: str) -> PeakMeter:
    if device.startswith("cuda"):
        return CudaPeakMeter(device if ":" in device else "cuda:0")
    if not HostPeakMeter.available():
        raise OSError("measuring a CPU stage's peak needs Linux's /proc/self/status and /proc/self/clear_refs")
    return HostPeakMeter()


@dataclass(slots=True)
class ProfileResult:
    stage: str
    record: ProfileRecord | None
    error: str | None = None


def _lengths(total: int, seqs: int) -> list[int]:
    """`seqs` prompt lengths (>= 1) that add up to `total`."""
    seqs = max(1, min(seqs, total))
    return [total // seqs + (1 if i < total % seqs else 0) for i in range(seqs)]


def _input_tokens(config: PipelineConfig, graph: StageGraph, stage: StageConfig, cap: int) -> int:
    """The longest input a one-shot stage gets: its upstream's max_tokens (e.g. the talker's codes)."""
    ups = graph.upstream[stage.name]
    n = max((config.stage(u).sampling.max_tokens or 0 for u in ups), default=0) or cap
    return max(1, min(n, cap))


def _profile_variant(stage: StageConfig, lengths: list[int]) -> StageConfig:
    """The stage as the pipeline would build it, with just the blocks the profile batch needs."""
    bs = stage.cache.block_size
    longest = max(lengths) + 1  # + the sampled token
    blocks = sum(-(-(n + 1) // bs) for n in lengths) + 1
    cache = stage.cache.model_copy(update={"num_blocks": blocks, "memory_budget_mb": None})
    sched = stage.scheduler.model_copy(update={"max_model_len": longest})
    return stage.model_copy(update={"cache": cache, "scheduler": sched})


def _default_inputs(stage: str, vocab: int, lengths: list[int], seed: int = 0) -> list[StageInput]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [StageInput(f"__profile_{stage}_{i}", prompt_token_ids=rng.integers(0, max(vocab, 1), n).tolist(),
                       sampling_params={"max_tokens": 1, "temperature": 0.0, "ignore_eos": True})
            for i, n in enumerate(lengths)]


def profile_stage(config: PipelineConfig, name: str, *, meter: PeakMeter | None = None,
                  build: Callable[[StageConfig], Any] | None = None) -> ProfileRecord:
    """Load the stage's model, run one profile step, measure. Raises what building or stepping raises."""
    from omni.pipeline.engine_factory import build_engine

    from omni.planning.needs import stage_device

    stage = config.stage(name)
    graph = StageGraph.of(config)
    import torch

    # Where the pipeline would put it ("auto" on Ray is the CPU unless the stage reserves a GPU), pinned
    # for the profile's engine: this process may see a GPU that the stage's actor would not.
    device = stage_device(stage, config.runtime.backend, torch.cuda.is_available())
    sched = stage.scheduler
    t0 = time.perf_counter()
    meter = meter or meter_for(device)
    built_from = meter.allocated() if isinstance(meter, CudaPeakMeter) else None
    if _is_autoregressive(stage):
        lengths = _lengths(sched.max_num_batched_tokens, sched.max_num_seqs)
        if not sched.enable_chunked_prefill and max(lengths) + 1 > sched.max_num_batched_tokens:
            lengths[lengths.index(max(lengths))] -= 1
        lengths = [n for n in lengths if n > 0]
        engine = (build or build_engine)(_profile_variant(stage, lengths).model_copy(update={"device": device}))
        vocab = engine.model.vocab_size
    else:
        engine = (build or build_engine)(stage.model_copy(update={"device": device}))
        cap = int(getattr(engine.model, "max_model_len", 0) or 1)
        lengths = [_input_tokens(config, graph, stage, cap)] * sched.max_num_seqs
        vocab = int(getattr(engine.model, "vocab_size", 1))
    inputs = engine.model.profile_inputs(lengths)
    if inputs is None:
        inputs = _default_inputs(name, vocab, lengths)
    # On a GPU, what building the engine allocated beyond the weights and the KV cache is device memory
    # the stage keeps: the runner's persistent input buffers and the CUDA graphs' pools (decode steps
    # are captured while the engine is built). It counts with the activations.
    kept = 0
    if built_from is not None:
        runner = getattr(engine, "runner", None)
        kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                 for k, v in getattr(runner, "kv_caches", ()))
        kept = max(0, meter.allocated() - built_from - kv - _header_weights(stage, device))
    try:
        # A warm-up request first: the first forward of a process faults in kernel code and one-time
        # buffers (tens of MiB of RSS) that are the process's, not this batch's.
        warm = inputs[0]
        engine.add_request(StageInput(f"{warm.request_id}_warmup", prompt=warm.prompt,
                                      prompt_token_ids=list(warm.prompt_token_ids or [])[:8] or None,
                                      prompt_embeds=warm.prompt_embeds, extra=dict(warm.extra), payload=warm.payload,
                                      sampling_params=warm.sampling_params))
        while engine.has_unfinished():
            engine.step()
        for inp in inputs:
            engine.add_request(inp)
        meter.start()
        while engine.has_unfinished():
            engine.step()
        peak = meter.peak()
        store = getattr(getattr(engine, "rows", None), "store", None)
        rows: dict[str, int] = {}
        held = 0
        if store is not None:
            for out, t in store.caches.items():
                rows[out] = int(t[0, 0].numel() * t.element_size())
            held = store.bytes_held
        # The tensor cache's rows are resident host memory the step wrote, not activations.
        activations = max(0, peak - (held if isinstance(meter, HostPeakMeter) else 0)) + kept
        return ProfileRecord(activations=activations, rows_per_token=rows, meter=meter.name,
                             seconds=round(time.perf_counter() - t0, 3))
    finally:
        engine.close()
        del engine
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()  # the next stage's profile starts from what the device really has free


def _header_weights(stage: StageConfig, device: str) -> int:
    from omni import registry
    from omni.engine.memory import DTYPE_BYTES

    from omni.planning.weights import checkpoint_weights

    prefix = registry.resolve_stage_model(stage.model).checkpoint_prefix
    w = checkpoint_weights(registry.resolve_model_path(stage.model_path), DTYPE_BYTES[stage.dtype], prefix)
    return w.bytes if w is not None else 0


def _is_autoregressive(stage: StageConfig) -> bool:
    from omni import registry

    return registry.stage_model_entry(stage.model).info.autoregressive


def profile_pipeline(config: PipelineConfig, store: ProfileStore, *,
                     meter_for_stage: Callable[[str], PeakMeter | None] | None = None,
                     progress: bool = False) -> list[ProfileResult]:
    """Profile every stage once (one copy: replicas are alike), one after the other, and keep each
    measurement in `store` for the plans made without loading anything. A stage that cannot be
    profiled keeps its estimate; the result says why. `progress`: a bar on stderr, a tick per stage and
    the stage being profiled (loading a real model and its step take minutes; as vLLM shows its loading)."""
    import torch
    from tqdm.auto import tqdm

    from omni import registry

    from omni.planning.needs import stage_device

    results = []
    bar = tqdm(config.stages, desc="Profiling stages", unit="stage", disable=not progress, dynamic_ncols=True)
    for stage in bar:
        bar.set_postfix_str(f"{stage.name}: loading, one step at its batch limits")
        device = stage_device(stage, config.runtime.backend, torch.cuda.is_available())
        key = profile_key(stage, registry.resolve_model_path(stage.model_path), device)
        try:
            record = profile_stage(config, stage.name, meter=meter_for_stage(stage.name) if meter_for_stage else None)
        except Exception as e:  # noqa: BLE001 - reported per stage; the plan keeps the estimate
            logger.warning("stage %s: profile step failed: %s: %s", stage.name, type(e).__name__, e)
            results.append(ProfileResult(stage.name, None, f"{type(e).__name__}: {e}"))
            continue
        store.put(key, record)
        results.append(ProfileResult(stage.name, record))
    return results
