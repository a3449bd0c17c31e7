"""The output head on a CPU: laid out and multiplied so that a decode step's logits run at memory speed.

Decoding samples one row per running request, so a decode step's logits are a product of a few rows
(one per request) with the head's [vocab, hidden] weight, and on a CPU that product is bound by reading
the weight (SmolLM2: 113 MB, the small Qwen2.5-Omni and Qwen3-Omni thinkers: 155 MB, once per step).
How fast MKL reads it depends on the weight's layout, on the operand order and on the number of rows.
`omni bench head` on the CI machine (AMD EPYC, one thread, fp32; ms per product, 151,936 x 256 / 49,152 x
576, one run, 2026-11-24):

    rows                                        1            2            4            8            16
    x @ W.T, W row-major (torch's default)      22.1 / 10.6  43.5 / 23.4  32.9 / 17.0  38.3 / 19.6  42.5 / 25.0
    x @ Wt, Wt = W.T contiguous (column-major)   7.4 /  5.2  14.6 / 10.4  23.2 / 20.6  25.5 / 23.0  31.1 / 28.7
    prepared (below)                             8.0 /  5.5  10.4 /  6.6  16.1 /  9.0  25.9 / 14.9  41.5 / 25.6

One row is fastest from a column-major weight; two to eight rows from the row-major weight with the
operands swapped, (W @ x.T).T; from about twelve rows on, neither layout wins on both heads (the
column-major one is 15-28% faster on the 256-wide head, 6-16% slower on the 576-wide one, up to 64
rows), so torch's own product runs there. A head larger than the CPU's last-level cache
(`LARGE_HEAD_BYTES`: every product streams the weight from DRAM) therefore keeps its row-major
parameter and gains a column-major copy: one row multiplies the copy, two to `SWAPPED_MAX_ROWS` rows
take the swapped product, more rows `linear`. The copy costs the head's size once more in host memory
(155 MB for the small thinkers); a tied input embedding keeps reading the row-major parameter,
untouched. A smaller head (a talker's codec head: 8.6 MB, in cache after its first step) is only
re-laid out column-major in place (`omni bench head --shapes 8448x256`, same run conditions: 1 / 2 / 4 / 8
rows 0.97 / 1.81 / 1.39 / 1.59 ms -> 0.37 / 0.71 / 1.03 / 1.23 ms).

The logits may differ from `linear`'s in the last bits (another summation order) as they already differ
between a row alone and the same row in a batch: the same rows always take the same product, so caching
on and off still compute the same logits, and the tests against transformers' `generate` hold. On a GPU,
or outside float32, nothing changes (cuBLAS reads either layout at full speed).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

# A head whose weight is larger than this is read from DRAM at every product (the CI machine's last-level
# cache is 32 MiB, shared by the stages): the dual layout pays there. Smaller ones stay in cache.
LARGE_HEAD_BYTES = 32 << 20
# Most rows for which the swapped product (W @ x.T) beats both `linear`s (the table above).
SWAPPED_MAX_ROWS = 8


def prepare_cpu_head(head: torch.nn.Module, device: torch.device) -> str | None:
    """Make `head` (an nn.Linear-like module with a 2-D `weight`) multiply at memory speed on a CPU in
    float32. Returns what it did: "dual" (a large head: column-major copy + row-count dispatch), "column"
    (a small head re-laid out column-major in place), or None (left alone: not a CPU float32 head, or
    already prepared). The parameter object stays the same either way, so a tied embedding follows."""
    weight = getattr(head, "weight", None)
    if (device.type != "cpu" or not isinstance(weight, torch.Tensor) or weight.dim() != 2
            or weight.dtype != torch.float32 or getattr(head, "_omni_head", None)):
        return None
    if weight.numel() * weight.element_size() <= LARGE_HEAD_BYTES:
        if weight.stride(0) == 1:
            return None
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()
        head._omni_head = "column"
        return "column"
    with torch.no_grad():
        if weight.stride(1) != 1:  # row-major for the swapped product and for a tied embedding's gathers
            weight.data = weight.data.contiguous()
        # A plain attribute, not a buffer: not part of the state dict, never saved or loaded.
        head._omni_weight_t = weight.data.t().contiguous()  # [hidden, vocab]
    # An instance attribute overrides the class's forward for this module only (nn.Module.__call__
    # looks `forward` up on the instance): every caller of `head(x)` gets the dispatch unchanged.
    head.forward = types.MethodType(_dual_forward, head)
    head._omni_head = "dual"
    return "dual"


def _dual_forward(head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`head(x)` for a large head (see the module docstring): the product each row count reads fastest."""
    weight, bias = head.weight, getattr(head, "bias", None)
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows == 0 or rows > SWAPPED_MAX_ROWS or torch.is_grad_enabled() and weight.requires_grad:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        out = flat @ head._omni_weight_t
    else:
        out = (weight @ flat.T).T.contiguous()  # contiguous: the sampler reads each row along the vocabulary
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
