"""A decoder's linear layers on a CPU: weights packed once for oneDNN, so a decode step's products stop
re-packing them.

A GEMM library multiplies a weight only after copying it into the blocked layout its kernels read
(packing). `F.linear` (MKL here) packs the weight at every call: for a prefill of thousands of rows the
copy is small next to the arithmetic, but a decode step multiplies a few rows (one per running request)
by every weight of every layer, so it pays the whole copy for little arithmetic. Packing each weight
once at load (`torch.ops.mkldnn._reorder_linear_weight`) and multiplying with oneDNN's packed product
(`torch.ops.mkldnn._linear_pointwise`, what PyTorch's own CPU compiler emits for frozen linears, and
what vLLM's CPU backend does with its oneDNN GEMM) takes that copy off every step, for a decode step's
few rows and a prefill chunk's thousands alike (`omni bench throughput` measures it: README's table).

Exactness: the packed product sums in another order than MKL's, so its results differ from `F.linear`'s
in the last bits (~1e-7 relative), as MKL's already differ between a row alone and the same row in a
batch of under 16. Packed with a batch hint of 32 (below), a row's result is the same whatever else is in
its batch (1 to 2,048 rows measured), so caching on and off still compute the same rows; the tests
against transformers' `generate` hold.

Where: the `causal_lm` stages' decoders (stages/causal_lm.py). The Qwen2.5-Omni and Qwen3-Omni stages
keep transformers' own products: with their thinker and talker packed, one of `omni bench capacity`'s 16
greedy replies flipped a near-tied codec code (code 227 of 250) against transformers' `generate`
(`audio_identical` 0), and on the small checkpoints packing bought nothing measurable: their cost is
the vocoder's. The Higgs Audio v2 stage keeps them too: packed, `omni bench tts`'s second reply in a voice
flipped a code at frame 146 of 175 (transformers' top two logits 1.2e-4 apart; `audio_identical` 0).

Memory: the packed copy is the layers' weights once more in host memory (SmolLM2: 425 MB); the
parameters stay as they are (the state dict, tied weights and `omni bench throughput`'s shapes read
them). Where that copy would take more than a quarter of the memory still free (a large fp32 model),
the layers stay on `F.linear`, with one warning. `OMNI_CPU_PACKED_LINEAR=0` turns packing off. On a
GPU, outside float32, or where this torch has no oneDNN, nothing changes.
"""
from __future__ import annotations

import logging
import os
import types

import torch
import torch.nn.functional as F

from omni.engine.memory import host_available

logger = logging.getLogger(__name__)

# The batch size oneDNN is told to expect: it picks the packed layout and kernel for it. A decode
# step's row count; any other count multiplies correctly with the same layout (1 to 2,048 rows tested).
BATCH_HINT = 32
# The packed copy may take at most this share of the host memory still free after the model loaded: the
# KV cache is sized after it, and other stages' processes share the machine.
MAX_SHARE_OF_FREE_MEMORY = 0.25


def enabled() -> bool:
    return os.environ.get("OMNI_CPU_PACKED_LINEAR", "1").strip().lower() not in ("0", "false", "no", "off")


def _packable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.numel() > 0 and getattr(module, "_omni_packed", None) is None
            and type(module).forward is torch.nn.Linear.forward)


def pack_cpu_linears(root: torch.nn.Module, device: torch.device) -> int:
    """Pack every float32 `nn.Linear` under `root` (a decoder's layers) for oneDNN on a CPU; returns how
    many were packed (0 where packing does not apply: see the module docstring). Each module keeps its
    parameters; its forward becomes the packed product."""
    if device.type != "cpu" or not enabled() or not torch.backends.mkldnn.is_available():
        return 0
    modules = [m for m in root.modules() if _packable(m)]
    need = sum(m.weight.numel() * m.weight.element_size() for m in modules)
    avail, source = host_available()
    if avail is not None and need > MAX_SHARE_OF_FREE_MEMORY * avail:
        logger.warning("not packing %d linear weights for oneDNN: the copy needs %.0f MiB, more than %.0f%% of the "
                       "%.0f MiB free (%s), which the KV cache and the other stages need; they stay on F.linear "
                       "(OMNI_CPU_PACKED_LINEAR=0 silences this)", len(modules), need / 2**20,
                       100 * MAX_SHARE_OF_FREE_MEMORY, avail / 2**20, source)
        return 0
    packed = 0
    for module in modules:
        try:
            module._omni_packed = pack_weight(module.weight)
        except (RuntimeError, AttributeError) as exc:  # a torch without the op: F.linear serves
            logger.warning("oneDNN weight packing unavailable, linears stay on F.linear: %s", exc)
            return packed
        # An instance attribute overrides the class's forward for this module only (as output_head.py).
        module.forward = types.MethodType(_packed_forward, module)
        packed += 1
    return packed


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in], float32, CPU) copied into oneDNN's packed layout (an opaque tensor for
    `packed_linear`). Raises RuntimeError or AttributeError where this torch cannot."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the weight as `pack_weight` returned it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def needs_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether autograd records this product: the packed ops have no backward, so such a product (training,
    or a gradient for the input through frozen weights) takes F.linear."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))


def _packed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if needs_grad(x, module.weight, module.bias) or x.dtype != torch.float32:
        return F.linear(x, module.weight, module.bias)  # autograd or another dtype: the plain product
    return packed_linear(x, module._omni_packed, module.bias)
