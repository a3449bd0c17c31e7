"""Backend dispatch for the attention kernels.

    store_kv(key, value, key_cache, value_cache, slot_mapping, backend=None)
    paged_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                    seq_lens, scale, out=None, backend=None) -> out [T, Hq, D]

backend: "triton" | "cpu" | "torch" | None (auto: CUDA tensors -> triton, otherwise
cpu). "torch" is the pure-torch reference (kernels/reference.py); "cpu" is the same
path with the short-query sequences (decode) on the C kernel of kernels/cpu_attention.py,
which reads the paged cache in place (fp32 only; where the kernel cannot be built it is
"torch"). The environment variable OMNI_ATTENTION_BACKEND overrides the auto choice;
an explicit ``backend`` argument wins over both.

Triton is imported lazily, on the first Triton call: every stage process
imports this module and CPU serving should not pay for importing triton.
The Triton launchers live in ``kernels.paged_attention`` / ``kernels.store_kv``.
"""

from __future__ import annotations

import os

from kernels import cpu_attention
from kernels.reference import paged_attention_ref, store_kv_ref

BACKENDS = ("triton", "cpu", "torch")
ENV_VAR = "OMNI_ATTENTION_BACKEND"


def resolve_backend(backend: str | None, tensor) -> str:
    """The backend a call on ``tensor`` runs on (see module docstring)."""
    if backend is None:
        backend = os.environ.get(ENV_VAR, "").strip().lower() or None
        if backend in (None, "auto"):
            return "triton" if tensor.is_cuda else "cpu"
        source = f"environment variable {ENV_VAR}"
    else:
        source = "backend"
    if backend not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)} (or unset for auto), got {backend!r}")
    return backend


_triton_impl = None


def _triton():
    global _triton_impl
    if _triton_impl is None:
        try:
            from kernels.paged_attention import paged_attention_triton
            from kernels.store_kv import store_kv_triton
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(f"backend 'triton' needs the triton package: {exc}") from exc
        _triton_impl = (store_kv_triton, paged_attention_triton)
    return _triton_impl


def store_kv(key, value, key_cache, value_cache, slot_mapping, backend: str | None = None) -> None:
    """Write K/V rows [T, Hkv, D] into the paged caches at slot_mapping (negative = skip)."""
    if resolve_backend(backend, key) != "triton":
        return store_kv_ref(key, value, key_cache, value_cache, slot_mapping)
    return _triton()[0](key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                    out=None, backend: str | None = None):
    """Causal varlen attention over the paged cache -> [T, Hq, D] (see kernels/reference.py)."""
    resolved = resolve_backend(backend, query)
    if resolved != "triton":
        short = None
        if (resolved == "cpu" and cpu_attention.usable(query, key_cache, value_cache, block_tables)
                and (out is None or out.stride(2) == 1) and cpu_attention.kernel() is not None):
            short = cpu_attention.short_query_attention
        return paged_attention_ref(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                   scale, out=out, short_queries=short)
    return _triton()[1](query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out=out)
