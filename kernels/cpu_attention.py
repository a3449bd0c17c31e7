"""The CPU's short-query paged attention (kernels/cpu_attention.c), built on first use.

Decode steps on a CPU spent most of their attention time copying: the torch path (reference.py)
gathers each sequence's KV blocks into a contiguous copy per layer before SDPA reads it. The C kernel
reads the blocks in place (each key and value row once, for all its query rows), for the sequences with at most
MAX_BATCHED_QUERY_LEN query tokens; prefills stay on SDPA (reference.py `_attend_one`), where the
copy is small next to the arithmetic. `omni bench kernels --cpu` times both on one decode batch.

Built with the system C compiler (`$CC`, else `cc`) at `-O3 -march=native`, once per source, compiler
and CPU, into `$OMNI_KERNEL_CACHE` (default `~/.cache/omni/kernels`): about a second; `make install`
builds it. Without a compiler, or when the build fails, the torch path serves every call (one
warning in the log): results differ only in float rounding (the tests bound it).

Used for fp32 caches only (a reduced-precision cache keeps SDPA's kernels, which accumulate in fp32).
`OMNI_ATTENTION_BACKEND=torch` turns it off (kernels/dispatch.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_fn = None
_failure: str | None = None  # why the kernel is not available (after a first try)


def cache_dir() -> Path:
    return Path(os.environ.get("OMNI_KERNEL_CACHE") or Path.home() / ".cache" / "omni" / "kernels")


def _cpu_flags() -> str:
    """The CPU's feature flags: a library built with -march=native runs only where they all exist."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build(cc: str) -> Path:
    source = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    target = cache_dir() / f"cpu_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes building at once (stage actors) never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed ({res.returncode}): {res.stderr.strip()[-600:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def kernel():
    """The loaded C function, or None when it cannot be built here (the reason is logged once)."""
    global _fn, _failure
    if _fn is not None or _failure is not None:
        return _fn
    with _lock:
        if _fn is not None or _failure is not None:
            return _fn
        cc = os.environ.get("CC") or "cc"
        try:
            if shutil.which(cc) is None:
                raise RuntimeError(f"no C compiler ({cc!r} is not on PATH)")
            lib = ctypes.CDLL(str(_build(cc)))
            fn = lib.omni_paged_short_attention
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            fn.argtypes = [p, i64, i64, p, p, i64, i64, i64, i64, p, i64, i64, p, p, p, p, ctypes.c_float, p, i64,
                           i64, ctypes.c_int]
            fn.restype = ctypes.c_int
            _fn = fn
        except Exception as exc:  # noqa: BLE001 - the torch path serves instead
            _failure = f"{type(exc).__name__}: {exc}"
            logger.warning("CPU paged attention kernel unavailable, decode attention runs on torch: %s", _failure)
    return _fn


def failure() -> str | None:
    """Why kernel() is None (None before the first try or when it loaded)."""
    return _failure


def usable(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           block_tables: torch.Tensor) -> bool:
    """Whether this call can run on the C kernel (CPU, fp32, the layouts it reads) once it is built."""
    return (query.device.type == "cpu" and query.dtype == key_cache.dtype == value_cache.dtype == torch.float32
            and query.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
            and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1)


def short_query_attention(query, key_cache, value_cache, block_tables, out, seqs: list[int], starts: list[int],
                          q_lens: list[int], seq_lens: list[int], scale: float) -> None:
    """out[rows of each listed sequence] = its causal attention over its cached context (see the C source);
    the caller checked `usable` and that `kernel()` is not None. out: [T, Hq, D], D contiguous."""
    fn = kernel()
    _, block_size, hkv, d = key_cache.shape
    meta = torch.tensor([seqs, starts, q_lens, seq_lens], dtype=torch.int64)
    ptr = meta.data_ptr()
    n = len(seqs)
    rc = fn(query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
            block_size, hkv, d, query.shape[1], block_tables.data_ptr(), block_tables.stride(0), n,
            ptr, ptr + 8 * n, ptr + 16 * n, ptr + 24 * n, scale, out.data_ptr(), out.stride(0), out.stride(1),
            torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU paged attention: out of memory for its per-thread scratch")
