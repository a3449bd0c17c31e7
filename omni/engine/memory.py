"""What a stage's caches will cost, checked before any of them is allocated.

A stage holds three structures whose size grows with `cache.num_blocks`:

    KV cache       2 (K and V) * layers * num_blocks * block_size * kv_heads * head_dim * dtype size
                   on the stage's device (GPU memory on CUDA, host RAM on CPU)
    tensor cache   num_blocks * block_size * hidden_size * dtype size, host RAM: the
                   row store of a stage that hands rows out (hidden states; other
                   per-token outputs are discovered at run time and come on top)
    block pool     one KVCacheBlock object per block, plus its prefix-cache hash
                   when caching is on, host RAM

A `num_blocks` of a billion would otherwise build a billion Python objects for
minutes and die with an empty MemoryError. `check_stage_memory` refuses such a
config at once, naming the field and the numbers. The engine calls it twice:
before loading the model, with the geometry read from the checkpoint's config
(so a bad value fails before minutes of loading), and after, with the loaded
model's own geometry, before the KV cache, block pool and tensor cache exist.

No torch here: the GPU is asked through torch only when a stage runs on CUDA.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omni.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Measured (tracemalloc) on CPython 3.11: a KVCacheBlock with __slots__ plus its
# slot in the pool's list is 112 bytes; a cached block adds its 16-byte hash
# (a 49-byte bytes object) and its entry in the hash -> block map (~90 bytes),
# rounded up.
POOL_BYTES_PER_BLOCK = 112
HASH_BYTES_PER_BLOCK = 160
# Leave room for activations, the sampler and the rest of the process.
USABLE_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class StageGeometry:
    """The model facts that size a stage's caches."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int  # width of the hidden states kept in the tensor cache
    # What the planner's activation estimate needs (omni/planning/needs.py); 0: not in the config.
    # Not compared: two geometries that size the caches alike are equal.
    num_heads: int = field(default=0, compare=False)
    intermediate_size: int = field(default=0, compare=False)
    vocab_size: int = field(default=0, compare=False)
    max_position_embeddings: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    kv_bytes: int
    tensor_cache_bytes: int
    block_pool_bytes: int
    per_block_bytes: int  # all three, for one block


@dataclass(frozen=True, slots=True)
class AvailableMemory:
    host_bytes: int | None  # None: unknown on this platform (the host check is skipped)
    host_source: str
    gpu_bytes: int | None = None  # free memory of the stage's GPU; None when it runs on CPU


def checkpoint_geometry(model_path: str | os.PathLike[str], *keys: str) -> StageGeometry | None:
    """The geometry in the checkpoint directory's config.json, under `keys` (e.g. "thinker_config",
    "text_config"), from Llama/Qwen2-style fields; None when there is no such config (a GGUF file)."""
    try:
        cfg: Any = json.loads((Path(model_path) / "config.json").read_text())
        for key in keys:
            cfg = cfg[key]
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        return StageGeometry(
            num_layers=int(cfg["num_hidden_layers"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            hidden_size=hidden,
            num_heads=heads,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            vocab_size=int(cfg.get("vocab_size") or 0),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        return None


def estimate(num_blocks: int, block_size: int, geometry: StageGeometry, dtype_bytes: int, *,
             prefix_caching: bool, tensor_cache: bool) -> MemoryEstimate:
    g = geometry
    kv = 2 * g.num_layers * block_size * g.num_kv_heads * g.head_dim * dtype_bytes
    rows = block_size * g.hidden_size * dtype_bytes if tensor_cache else 0
    pool = POOL_BYTES_PER_BLOCK + (HASH_BYTES_PER_BLOCK if prefix_caching else 0)
    return MemoryEstimate(kv * num_blocks, rows * num_blocks, pool * num_blocks, kv + rows + pool)


def _cgroup_available() -> int | None:
    """Room left under a cgroup v2 memory limit (containers), if there is one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def host_available() -> tuple[int | None, str]:
    """Host memory this process can still get: psutil if installed, else /proc/meminfo MemAvailable."""
    avail, source = None, "unknown"
    try:
        import psutil

        avail, source = int(psutil.virtual_memory().available), "available host RAM"
    except ImportError:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    avail, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
                    break
        except (OSError, ValueError, IndexError):
            pass
    cg = _cgroup_available()
    if cg is not None and (avail is None or cg < avail):
        avail, source = max(cg, 0), "room under the cgroup memory limit"
    return avail, source


def gpu_available(device: str) -> int | None:
    """Free memory on the CUDA device the KV cache goes to (torch.cuda.mem_get_info); None on CPU."""
    if not (device == "auto" or device.startswith("cuda")):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device("cuda" if device == "auto" else device))
    return int(free)


def available_memory(device: str) -> AvailableMemory:
    host, source = host_available()
    return AvailableMemory(host, source, gpu_available(device))


def _size(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def check_stage_memory(stage: str, field: str, value: Any, num_blocks: int, block_size: int,
                       geometry: StageGeometry | None, dtype_bytes: int, device: str, *, prefix_caching: bool,
                       tensor_cache: bool, probe: Callable[[str], AvailableMemory] | None = None) -> MemoryEstimate:
    """Raise ConfigError naming `field` of `stage` when the caches cannot fit; else return the estimate.

    `value`: the field's configured value (cache.num_blocks, or cache.memory_budget_mb when the block
    count derives from it). `geometry` None: the model is not known yet, only the block pool counts.
    `device`: where the KV cache goes ("cpu", "cuda", "cuda:1", "auto").
    """
    est = estimate(num_blocks, block_size, geometry or StageGeometry(0, 0, 0, 0), dtype_bytes,
                   prefix_caching=prefix_caching, tensor_cache=tensor_cache)
    avail = (probe or available_memory)(device)
    on_gpu = avail.gpu_bytes is not None
    where = "cuda" if device == "auto" else device  # "auto" on a machine with a GPU puts the cache there
    kv_per_block = est.kv_bytes // max(num_blocks, 1)
    if geometry is None:
        parts = f"block pool {_size(est.block_pool_bytes)}; KV and tensor cache not counted before the model loads"
    else:
        parts = (f"KV cache {_size(est.kv_bytes)}{' on ' + where if on_gpu else ''}, "
                 f"tensor cache {_size(est.tensor_cache_bytes)}, block pool {_size(est.block_pool_bytes)}")
    blocks = f"{num_blocks:,} blocks of {block_size} tokens"
    what = f"stage {stage!r}: {field}: " + (blocks if value == num_blocks else f"{value} gives {blocks}")
    def fit(per_block: int, usable: int) -> str:
        return f"; at most {usable // max(per_block, 1):,} blocks fit" if geometry is not None else ""

    if on_gpu and est.kv_bytes > (usable := int(avail.gpu_bytes * USABLE_FRACTION)):
        raise ConfigError(
            f"{what}: the KV cache needs {_size(est.kv_bytes)} but {where} has {_size(avail.gpu_bytes)} "
            f"free (usable: {USABLE_FRACTION:.0%}){fit(kv_per_block, usable)} ({parts})")
    host_need = est.tensor_cache_bytes + est.block_pool_bytes + (0 if on_gpu else est.kv_bytes)
    host_per_block = est.per_block_bytes - (kv_per_block if on_gpu else 0)
    if avail.host_bytes is not None and host_need > (usable := int(avail.host_bytes * USABLE_FRACTION)):
        raise ConfigError(
            f"{what}: they need {_size(host_need)} of host memory but only {_size(avail.host_bytes)} is free "
            f"({avail.host_source}; usable: {USABLE_FRACTION:.0%}){fit(host_per_block, usable)} ({parts})")
    return est


# ------------------------------------------------------------- engine glue
# `config` is the engine's resolved stage config (name, model_cls, model_path, block_size, num_blocks,
# memory_budget_mb, enable_prefix_caching, emit_hidden_states, dtype, device).
def _field(config: Any) -> tuple[str, Any]:
    if config.num_blocks is not None:
        return "cache.num_blocks", config.num_blocks
    return "cache.memory_budget_mb", config.memory_budget_mb


def _check(config: Any, num_blocks: int, geometry: StageGeometry | None, dtype_bytes: int, device: str,
           probe: Callable[[str], AvailableMemory] | None) -> MemoryEstimate:
    field, value = _field(config)
    return check_stage_memory(
        config.name, field, value, num_blocks, config.block_size, geometry, dtype_bytes, device,
        prefix_caching=config.enable_prefix_caching, tensor_cache=config.emit_hidden_states, probe=probe)


def check_before_load(config: Any, probe: Callable[[str], AvailableMemory] | None = None) -> None:
    """Before the model loads: the geometry comes from the checkpoint's config when the stage model
    can read it (`checkpoint_geometry`); an explicit num_blocks is checked in any case."""
    geometry = config.model_cls.checkpoint_geometry(Path(config.model_path))
    dtype_bytes = DTYPE_BYTES.get(config.dtype, 4)
    num_blocks = config.num_blocks
    if num_blocks is None and config.memory_budget_mb is not None and geometry is not None:
        kv = estimate(1, config.block_size, geometry, dtype_bytes, prefix_caching=False, tensor_cache=False)
        num_blocks = int(config.memory_budget_mb * 2**20 // max(kv.kv_bytes, 1))
    if num_blocks is not None:
        _check(config, num_blocks, geometry, dtype_bytes, config.device, probe)


def check_loaded(config: Any, model: Any, num_blocks: int,
                 probe: Callable[[str], AvailableMemory] | None = None) -> MemoryEstimate:
    """With the loaded model's own geometry, before the KV cache, block pool and tensor cache exist."""
    spec = model.kv_spec()
    geometry = StageGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, int(model.hidden_size))
    return _check(config, num_blocks, geometry, model.dtype.itemsize, str(model.device), probe)
