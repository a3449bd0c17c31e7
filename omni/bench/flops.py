"""How close forward passes come to the machine's own GEMM rate (`omni bench throughput`).

Forward FLOPs of a decoder LM (multiply-adds count 2):

    per computed token      2 x (the decoder layers' linear weights)  +  attention: per layer
                            4 x (keys attended) x (query heads x head_dim)  (QK^T and AV)
    per sampled row         2 x the output head's weight (logits only where a token is sampled)

The machine's rate is measured in the same process, on the same thread count, with `F.linear` on the
model's own weights (every distinct layer shape, and the head as laid out) at the run's step sizes:
what a GEMM library gets on exactly these shapes. `mfu_vs_sgemm` = achieved / that (float32:
sgemm; another dtype: that dtype's GEMM). On a CPU in float32 the same shapes are also timed with
oneDNN's product on weights packed once (what omni's decoders run: omni/engine/runner/cpu_linear.py),
faster than sgemm on small batches; `mfu_vs_best_gemm` = achieved / the faster of the two at each
shape, the stricter ratio (a forward pass cannot beat it by choosing a GEMM). Norms, activations,
rotary embeddings and the attention's softmax are not counted (a few percent of a step), so the
ratio is a slight underestimate.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DecoderShape:
    layer_weights: list[torch.Tensor]  # every linear weight of the decoder layers, [out, in]
    head: torch.Tensor  # the output head's weight, [vocab, hidden] (any memory layout)
    num_layers: int
    attention_width: int  # query heads x head_dim

    @property
    def layer_params(self) -> int:
        return sum(w.numel() for w in self.layer_weights)


def decoder_shape(model) -> DecoderShape:
    """The matmul shapes of a transformers decoder LM (the model a causal_lm stage runs: stages/causal_lm.py
    takes its decoder and head through the same accessors)."""
    layers = model.get_decoder().layers
    weights = [m.weight for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return DecoderShape(weights, model.get_output_embeddings().weight, len(layers), cfg.num_attention_heads * head_dim)


def meta_model(path) -> torch.nn.Module:
    """The transformers model at `path` with its weights on the meta device: shapes for FLOP counts,
    no memory and no loading."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))


def forward_flops(shape: DecoderShape, spans: list[tuple[int, int]], sampled_rows: int) -> tuple[float, float]:
    """FLOPs of computing positions [start, end) of each sequence in `spans`: (decoder layers with their
    attention, output head for `sampled_rows` logits rows)."""
    tokens = sum(end - start for start, end in spans)
    # Token at position p attends p + 1 keys: sum over [start, end) of (p + 1).
    keys = sum((end * (end + 1) - start * (start + 1)) // 2 for start, end in spans)
    layers = 2.0 * shape.layer_params * tokens + 4.0 * shape.num_layers * shape.attention_width * keys
    return layers, 2.0 * shape.head.numel() * sampled_rows


def _products(w: torch.Tensor) -> dict:
    """The GEMMs this machine offers for `x @ w.T`, by name: "sgemm" (F.linear: MKL's sgemm on a CPU,
    cuBLAS on a GPU) and, on a CPU in float32, "packed" (oneDNN's product on the weight packed once:
    omni/engine/runner/cpu_linear.py, what omni's decoders run)."""
    products = {"sgemm": lambda x: torch.nn.functional.linear(x, w)}
    if w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        from omni.engine.runner.cpu_linear import pack_weight, packed_linear

        try:
            packed = pack_weight(w)
        except (RuntimeError, AttributeError):
            return products
        products["packed"] = lambda x: packed_linear(x, packed, None)
    return products


def _linear_seconds(w: torch.Tensor, rows: int, budget_s: float) -> dict[str, float]:
    """Seconds per product of each GEMM (`_products`) on `w` with `rows` input rows, and "best": the
    fastest of them."""
    timed = {}
    with torch.inference_mode():
        x = torch.randn(max(1, rows), w.shape[1], dtype=w.dtype, device=w.device)
        products = _products(w)
        for name, product in products.items():
            product(x)  # warm-up (threads, packing)
            n, t0 = 0, time.perf_counter()
            while True:
                product(x)
                n += 1
                if w.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                if elapsed >= budget_s / len(products):
                    break
            timed[name] = elapsed / n
    timed["best"] = min(timed.values())
    return timed


def _bucket(rows: int) -> int:
    """Rows rounded up to a power of two: one GEMM timing serves every step of that size."""
    return 1 << max(0, rows - 1).bit_length()


def gemm_gflops(shape: DecoderShape, flops: tuple[float, float], steps: list[tuple[int, int]],
                budget_s: float = 0.5) -> dict[str, float]:
    """The machine's GEMM rate on this run's work, {"sgemm": F.linear's, "best": the fastest GEMM's at
    each shape (see `_products`)}. `steps`: each forward pass's (rows, sampled rows). Every distinct layer
    shape and the head are timed at each step size (rounded up to a power of two); the rate is the run's
    FLOPs over the time GEMMs at those rates would take: each step's layer and head FLOPs at its sizes'
    rates, the attention's at the layers' rate of the mean step."""
    distinct: dict[tuple[int, ...], tuple[torch.Tensor, int]] = {}
    for w in shape.layer_weights:
        first, count = distinct.get(tuple(w.shape), (w, 0))
        distinct[tuple(w.shape)] = (first, count + 1)
    total = sum(w.numel() * c for w, c in distinct.values())
    mean_rows = sum(r for r, _ in steps) // max(1, len(steps))
    sizes = sorted({_bucket(r) for r, _ in steps} | {_bucket(mean_rows)})
    head_sizes = sorted({_bucket(k) for _, k in steps if k})
    each = budget_s / max(1, len(sizes) * len(distinct) + len(head_sizes))
    # Seconds per layer FLOP at each size: the distinct shapes weighted by how often they occur.
    layer_t = {m: [(_linear_seconds(w, m, each), w.numel() * c / total / (2.0 * max(1, m) * w.numel()))
                   for w, c in distinct.values()] for m in sizes}
    head_t = {m: (_linear_seconds(shape.head, m, each), 1 / (2.0 * max(1, m) * shape.head.numel()))
              for m in head_sizes}
    layers, head = flops
    per_row = 2.0 * shape.layer_params
    linear_flops = per_row * sum(r for r, _ in steps)
    rates = {}
    for key in ("sgemm", "best"):
        layer_s = {m: sum(t[key] * share for t, share in parts) for m, parts in layer_t.items()}
        head_s = {m: t[key] * per_flop for m, (t, per_flop) in head_t.items()}
        seconds = sum(per_row * r * layer_s[_bucket(r)] for r, _ in steps)
        seconds += (layers - linear_flops) * layer_s[_bucket(mean_rows)]  # attention
        seconds += sum(2.0 * shape.head.numel() * k * head_s[_bucket(k)] for _, k in steps if k)
        rates[key] = (layers + head) / seconds / 1e9
    return rates
