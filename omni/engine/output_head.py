"""The output head's weight layout on a CPU: column-major, for one-row logits at memory speed.

Decoding samples one row per request, so the logits of a decode step are a matrix-vector product
with the head's [vocab, hidden] weight, and on a CPU that product is bound by reading the weight
(SmolLM2: 113 MB, the small Qwen2.5-Omni thinker: 155 MB, once per step). MKL's product reads a
row-major weight (torch's default, `x @ W.T` with W contiguous) at about half the bandwidth it gets
from the same weight stored column-major (`x @ Wt` with Wt = W.T contiguous), measured on the CI
machine (AMD EPYC, one thread, fp32):

    weight             row-major   column-major
    151,936 x 256      22.9 ms     11.1 ms      (small Qwen2.5-Omni thinker)
    49,152 x 576       13.5 ms      7.3 ms      (SmolLM2-135M)
    8,448 x 256         1.2 ms      0.3 ms      (small Qwen2.5-Omni talker)

So on a CPU the head keeps the same values, stored column-major: `linear` then multiplies by the
contiguous transpose. The logits may differ from the row-major product's in the last bits (another
summation order; measured: one to three rows differ, four or more run the same GEMM bitwise), as
they already differ between a row alone and the same row in a batch; caching on and off still
run the same products, and the tests against transformers' `generate` hold. A tied input embedding shares the
weight and reads rows from the new layout (a prefill of 2,000 tokens: ~25 ms more on SmolLM2,
decode: microseconds). On a GPU nothing changes (cuBLAS reads either layout at full speed).
"""
from __future__ import annotations

import torch


def use_column_major_head(head: torch.nn.Module, device: torch.device) -> bool:
    """Re-lay out `head.weight` column-major when the stage decodes on a CPU in float32.

    Returns whether it did. The parameter object stays the same (so a tied embedding follows)."""
    weight = getattr(head, "weight", None)
    if (device.type != "cpu" or not isinstance(weight, torch.Tensor) or weight.dim() != 2
            or weight.dtype != torch.float32 or weight.stride(0) == 1):
        return False
    with torch.no_grad():
        weight.data = weight.data.t().contiguous().t()
    return True
