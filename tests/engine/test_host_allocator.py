"""host_allocator: a freed activation-sized block is reused without page faults once tuned.

Each case runs in a fresh interpreter (no torch: the probe allocates with libc itself), because the
settings are per process and glibc reads its MALLOC_* variables at start-up.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# 24 MiB, the size of a prefill's activations: by default glibc serves it from a fresh mmap (or hands the
# freed block back to the kernel), so its pages fault in on every touch; tuned, it comes from the heap and
# the second allocation reuses the pages the first touched.
_PROBE = r"""
import ctypes, ctypes.util, json, resource, sys
from omni.engine.runner.host_allocator import tune_host_allocator
outcome = tune_host_allocator()
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 24 << 20
def touch():
    p = libc.malloc(size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ctypes.memset(p, 1, size)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(p)
    return faults
touch()
print(json.dumps({"outcome": outcome, "faults": touch(), "pages": size // resource.getpagesize(),
                  "again": tune_host_allocator() == outcome}))
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="mallopt is glibc's")


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "OMNI_HOST_ALLOCATOR"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@glibc
def test_tuned_process_reuses_a_freed_block_without_faults():
    tuned = _probe()
    assert tuned["outcome"] == {"applied": True, "settings": {"M_MMAP_THRESHOLD": 32 << 20,
                                                              "M_TRIM_THRESHOLD": 256 << 20,
                                                              "M_TOP_PAD": 16 << 20}}
    assert tuned["again"]  # once per process
    assert tuned["faults"] < tuned["pages"] // 20
    default = _probe(OMNI_HOST_ALLOCATOR="default")
    assert default["outcome"] == {"applied": False, "reason": "OMNI_HOST_ALLOCATOR=default"}
    assert default["faults"] > tuned["pages"] // 2  # what the tuning saves: every page faults again


@glibc
def test_user_glibc_settings_win():
    out = _probe(MALLOC_TRIM_THRESHOLD_="1048576")
    assert out["outcome"] == {"applied": False,
                              "reason": "glibc settings from the environment: MALLOC_TRIM_THRESHOLD_"}


def test_unknown_choice_is_refused(monkeypatch):
    from omni.engine.runner import host_allocator

    monkeypatch.setenv("OMNI_HOST_ALLOCATOR", "jemalloc")
    with pytest.raises(ValueError, match="OMNI_HOST_ALLOCATOR must be 'tuned' or 'default', got 'jemalloc'"):
        host_allocator._tune()
