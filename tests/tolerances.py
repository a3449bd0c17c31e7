"""How far apart two floating-point evaluations of the same math may be, derived from the computation.

Two paths that compute the same thing (a prompt fed whole vs in pieces, cached rows vs recomputed ones,
a padded batch vs an exact one, a Triton kernel vs its torch reference) differ only in how their sums
are blocked and ordered: the BLAS / oneDNN / Triton kernel picked for a shape, the vector width of the
CPU, the number of query rows in a step. Those choices differ between machines, so a tolerance picked by
hand from one machine's observed difference fails on another. Here it comes from the computation:

One sum of `n` terms, computed in any order, is within gamma(n) * sum|terms| of the exact sum, with
gamma(n) = n*u / (1 - n*u) and u the dtype's unit roundoff (eps / 2): Higham, "Accuracy and Stability
of Numerical Algorithms", 2nd ed., eq. (3.4)-(3.5) (recursive summation) and sec. 4.2 (any order or
blocking). Two orders of the same sum are each within that of the exact value, so within twice it of
each other. A chain of `depth` sums in sequence (the layers of a model) adds its errors to first order.

Every bound here is an upper bound on what reordering can do, typically 10-1000x above what is
observed, and still far below what a real bug makes (a wrong row, a dropped block, a shifted
position change values by their own magnitude): `assert_rows_close` checks that second property on
the reference itself, so the tolerance it is given cannot be loose enough to hide a wrong row.
"""
from __future__ import annotations

import numpy as np
import torch

# Sequential reductions in one pre-norm decoder layer, input to output: RMSNorm (mean of squares),
# q/k/v projections, q.k scores, softmax denominator, probabilities @ V, o_proj, RMSNorm,
# gate/up projections, down projection.
SUMS_PER_DECODER_LAYER = 9


def unit_roundoff(dtype) -> float:
    """u = eps / 2: the largest relative error of one rounding in `dtype` (numpy or torch dtype)."""
    if isinstance(dtype, torch.dtype):
        return torch.finfo(dtype).eps / 2
    return float(np.finfo(dtype).eps) / 2


def gamma(n: int, dtype=np.float32) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): relative error bound of a sum of n terms in any order."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"a sum of {n} terms in {dtype} has no error bound (n*u = {nu:.3g} >= 1)")
    return nu / (1 - nu)


def reorder_atol(length: int, magnitude: float, *, depth: int = 1, dtype=np.float32) -> float:
    """Largest |a - b| between two evaluations that differ only in the order of their sums.

    length: terms in the longest sum of the chain; magnitude: a bound on sum|terms| at the scale of the
    compared values (the caller says why it holds); depth: sums in sequence from input to output.
    """
    return 2 * depth * gamma(length, dtype) * magnitude


def decoder_atol(reference, *, layers: int, widest_sum: int, dtype=np.float32) -> float:
    """Bound for the final hidden states of a pre-norm decoder computed two ways.

    The last hidden state is RMS-normalised, and so is the input of every sub-layer, so each sum in the
    chain has terms at the scale of the normalised values: the largest |reference| bounds it (times the
    norm weights, which the reference already includes). widest_sum: the longest sum in any layer, i.e.
    max(hidden size, intermediate size, number of attended positions). depth: the sums per decoder layer
    (SUMS_PER_DECODER_LAYER) times the layers, plus the final norm.
    """
    magnitude = float(np.abs(np.asarray(reference, dtype=np.float64)).max())
    return reorder_atol(widest_sum, magnitude, depth=layers * SUMS_PER_DECODER_LAYER + 1, dtype=dtype)


def logprobs_atol(hidden_ref, head_weight, *, layers: int, widest_sum: int, dtype=np.float32) -> float:
    """Bound for log-softmax(hidden @ head_weight.T) computed two ways from final hidden states that differ
    by at most decoder_atol (the same sums, ordered differently).

    A logit is a sum of H = hidden-size terms h_i * w_ji: the hidden states' error contributes at most
    decoder_atol * max_j sum_i |w_ji|, the sum's own order at most reorder_atol(H, max|h| * max_j sum_i |w_ji|).
    log-softmax moves by at most twice the largest logit error (x_j - logsumexp(x): logsumexp is 1-Lipschitz
    in the max norm), plus its own rounding: a sum of V terms exp(x - max) <= 1, relative error gamma(V).
    """
    hidden_ref = np.asarray(hidden_ref, dtype=np.float64)
    w = np.abs(np.asarray(head_weight, dtype=np.float64))
    row_l1 = float(w.sum(axis=1).max())
    h_err = decoder_atol(hidden_ref, layers=layers, widest_sum=widest_sum, dtype=dtype)
    logit_err = h_err * row_l1 + reorder_atol(w.shape[1], float(np.abs(hidden_ref).max()) * row_l1, dtype=dtype)
    return 2 * logit_err + gamma(w.shape[0], dtype)


def assert_rows_close(got, ref, atol: float, what: str = "rows") -> None:
    """|got - ref| <= atol everywhere, and `atol` is tight enough to see one row taken for another.

    Each row of `ref` differs from the next one by more than `atol` somewhere, or the comparison could
    not tell a shifted or repeated row (the typical caching bug) from rounding: that is asserted first.
    """
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert ref.size, f"{what}: nothing to compare"
    if ref.ndim == 2 and len(ref) > 1:
        neighbour = np.abs(np.diff(ref, axis=0)).max(axis=1).min()
        assert neighbour > atol, (f"{what}: atol {atol:.3g} would not catch a wrong row "
                                  f"(two adjacent rows differ by at most {neighbour:.3g})")
    diff = np.abs(got - ref)
    worst = np.unravel_index(int(diff.argmax()), diff.shape)
    assert diff.max() <= atol, (f"{what}: max |diff| {diff.max():.3g} at {tuple(int(i) for i in worst)} "
                                f"> atol {atol:.3g} ({int((diff > atol).sum())} of {diff.size} elements)")


def attention_atol(batch: dict, scale: float, *, compute=torch.float32, scores=None, probs=None,
                   out=None) -> float:
    """Bound for paged attention, softmax(scale * q.k) @ v per query, computed by two implementations.

    batch: make_batch's tensors (query, key_cache, value_cache, seq_lens); compute: the dtype sums are
    accumulated in; probs: the dtype probabilities are rounded to before P @ V (GPU low-precision
    kernels), if any; scores: the dtype scores are rounded to (a low-precision math path), if any;
    out: the dtype the output is stored in, if not `compute`.
    - scores: head_dim-term dot products, within 2*gamma(D)*scale*sum|q_i k_i| of each other; sum|q_i k_i|
      is the largest over the (query, key) pairs of the batch.
    - every score off by at most delta moves each probability by a factor within exp(+-2*delta); the
      output is a convex combination of V rows, so it moves by at most expm1(2*delta) * max|v|.
    - the softmax denominator and P @ V are sums over up to max(seq_lens) terms of weight <= 1 times
      |v|: 2*gamma(T) * max|v| each; exp itself: a few ulps (4u) per side.
    - rounding probabilities to `probs`: u(probs) * max|v|; storing to `out`: one ulp, 2u(out) * max|v|
      (round to nearest or truncation).
    """
    d = batch["query"].shape[-1]
    q = batch["query"].double().abs().reshape(-1, d)
    k = batch["key_cache"].double().abs().reshape(-1, d)
    v_max = float(batch["value_cache"].double().abs().max()) if batch["value_cache"].numel() else 0.0
    dot = float((q @ k.T).max()) if q.numel() and k.numel() else 0.0
    length = max([int(s) for s in batch["seq_lens"]] + [1])
    return attention_bound(d, length, dot, v_max, scale, compute=compute, scores=scores, probs=probs, out=out)


def attention_bound(head_dim: int, length: int, dot: float, v_max: float, scale: float, *,
                    compute=torch.float32, scores=None, probs=None, out=None) -> float:
    """attention_atol from its numbers: dot bounds sum|q_i k_i| over (query, key) pairs, v_max |v|."""
    delta = reorder_atol(head_dim, scale * dot, dtype=compute)
    if scores is not None:
        delta += unit_roundoff(scores) * scale * dot
    rel = float(np.expm1(2 * delta)) + 2 * reorder_atol(length, 1.0, dtype=compute) + 8 * unit_roundoff(compute)
    if probs is not None:
        rel += unit_roundoff(probs)
    if out is not None:
        rel += 2 * unit_roundoff(out)
    return rel * v_max
