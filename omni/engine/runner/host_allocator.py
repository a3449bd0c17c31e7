"""Keep freed host memory for the next forward pass instead of handing it back to the kernel.

Why: a CPU forward pass allocates and frees the same activation tensors step after step (a 2,048-token
prefill chunk's MLP rows alone are 12 MB each). glibc's malloc serves large blocks with fresh mmaps
and returns the free top of its heap to the kernel once it exceeds a few MB, so the next step touches
new pages and page-faults on each 4 KiB of them (`omni bench throughput` counts the steps' minor faults
with and without the settings below: README, "Host memory").
PyTorch's CPU performance guides reach for jemalloc or tcmalloc through LD_PRELOAD for the same reason;
glibc's own knobs (mallopt) get the step loop's share of it with nothing to install:

    M_MMAP_THRESHOLD  32 MiB   blocks below it come from the heap, which is reused, not from new mmaps
                               (glibc's own upper bound for its moving threshold: larger blocks, a
                               vocoder's waveform-length activations, stay mmapped as by default)
    M_TRIM_THRESHOLD 256 MiB   free heap top kept up to this much before it is returned to the kernel
    M_TOP_PAD         16 MiB   the heap grows in steps of at least this much

The price is bounded: a process keeps up to about 256 MiB of freed heap that the kernel could otherwise
reclaim. Off with OMNI_HOST_ALLOCATOR=default; left alone when the process is not on glibc or the user
set glibc's own MALLOC_*_ variables (their choice wins).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {"M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, 32 << 20), "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, 256 << 20),
            "M_TOP_PAD": (_M_TOP_PAD, 16 << 20)}
ENV = "OMNI_HOST_ALLOCATOR"
_GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")

_lock = threading.Lock()
_state: dict[str, object] = {}


def tune_host_allocator() -> dict[str, object]:
    """Apply SETTINGS once per process (later calls return the first outcome): {"applied": bool, "reason"
    when not, "settings" when applied}."""
    with _lock:
        if not _state:
            _state.update(_tune())
        return dict(_state)


def _tune() -> dict[str, object]:
    choice = os.environ.get(ENV, "tuned")
    if choice not in ("tuned", "default"):
        raise ValueError(f"{ENV} must be 'tuned' or 'default', got {choice!r}")
    if choice == "default":
        return {"applied": False, "reason": f"{ENV}=default"}
    user = [name for name in _GLIBC_ENV if name in os.environ]
    if user:
        return {"applied": False, "reason": f"glibc settings from the environment: {', '.join(user)}"}
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {"applied": False, "reason": "not glibc"}
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    for name, (param, value) in SETTINGS.items():
        if libc.mallopt(param, value) != 1:  # mallopt returns 1 on success
            return {"applied": False, "reason": f"mallopt({name}) refused {value}"}
    return {"applied": True, "settings": {name: value for name, (_, value) in SETTINGS.items()}}
