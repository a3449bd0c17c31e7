"""The output head on a CPU: laid out and multiplied so that a decode step's logits run at memory speed.

Decoding samples one row per running request, so a decode step's logits are a product of a few rows
(one per request) with the head's [vocab, hidden] weight, and on a CPU that product is bound by reading
the weight (SmolLM2: 113 MB, the small Qwen2.5-Omni and Qwen3-Omni thinkers: 155 MB, once per step).
How fast MKL reads it depends on the weight's layout, on the operand order and on the number of rows
(`omni bench head` times them side by side; its numbers are in README's benchmark table).

One row is fastest from a column-major weight; two to eight rows from the row-major weight with the
operands swapped, (W @ x.T).T; from about twelve rows on, neither layout wins on both heads (the
column-major one is faster on a narrow head and slower on a wide one), so torch's own product runs there.
A head larger than the CPU's last-level cache (`LARGE_HEAD_BYTES`: every product streams the weight from
DRAM) therefore keeps its row-major parameter and gains a column-major copy: one row multiplies the copy,
two to `SWAPPED_MAX_ROWS` rows take the swapped product, more rows `linear`. The copy costs the head's size
once more in host memory; a tied input embedding keeps reading the row-major parameter, untouched. A
smaller head (a talker's codec head, in cache after its first step) is only re-laid out column-major in
place, which is faster at every row count there.

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
