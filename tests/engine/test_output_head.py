"""The output head prepared for a CPU: same values, the same logits within summation reordering, the same
argmax, for every row count; tied embeddings follow; each row count always takes the same product."""
from __future__ import annotations

import pytest
import torch

from omni.engine.runner import output_head
from omni.engine.runner.output_head import prepare_cpu_head
from tests.tolerances import reorder_atol

CPU = torch.device("cpu")


def _close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    # Each logit is one K-term dot product; the layouts only sum it in another order: per logit, within
    # reorder_atol(K, sum_k |x_k * w_k|) of each other (tests/tolerances.py).
    atol = torch.tensor(reorder_atol(x.shape[-1], 1.0)) * (x.abs() @ weight.abs().T)
    assert got.shape == want.shape and got.is_contiguous()
    assert ((got - want).abs() <= atol).all()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@torch.inference_mode()
def test_a_small_head_is_laid_out_column_major_in_place():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False)
    before = head.weight.detach().clone()
    x = torch.randn(8, 64)
    want = head(x)
    param = head.weight
    assert prepare_cpu_head(head, CPU) == "column"
    assert head.weight is param  # the same parameter: a tied embedding follows
    assert head.weight.stride() == (1, 1000) and torch.equal(head.weight, before)
    for rows in (1, 2, 8):
        _close(head(x[:rows]), want[:rows], x[:rows], before)
    assert prepare_cpu_head(head, CPU) is None  # already prepared


@pytest.fixture
def large_threshold(monkeypatch):
    # A head "larger than the cache" at test size: the dispatch is what is tested, not the speed.
    monkeypatch.setattr(output_head, "LARGE_HEAD_BYTES", 16 << 10)


@torch.inference_mode()
def test_a_large_head_dispatches_on_the_row_count(large_threshold):
    torch.manual_seed(2)
    head = torch.nn.Linear(48, 3000, bias=True)
    before_w, before_b = head.weight.detach().clone(), head.bias.detach().clone()
    x = torch.randn(20, 48)
    want = head(x)
    param = head.weight
    assert prepare_cpu_head(head, CPU) == "dual"
    assert head.weight is param and head.weight.is_contiguous() and torch.equal(head.weight, before_w)
    assert head._omni_weight_t.shape == (48, 3000) and head._omni_weight_t.is_contiguous()
    assert "_omni_weight_t" not in head.state_dict()  # the copy is never saved
    for rows in (1, 2, 3, 8, 9, 20):  # column-major copy, swapped product, torch's linear
        _close(head(x[:rows]), want[:rows], x[:rows], before_w)
    # Leading dimensions are kept ([batch, seq, hidden] as transformers' heads get them).
    _close(head(x[:6].reshape(2, 3, 48)).reshape(6, 3000), want[:6], x[:6], before_w)
    assert head(x[:0]).shape == (0, 3000)
    assert torch.equal(head.bias, before_b)
    # The same rows always take the same product: bitwise repeatable, batch to batch.
    for rows in (1, 4, 12):
        assert torch.equal(head(x[:rows]), head(x[:rows].clone()))
    assert prepare_cpu_head(head, CPU) is None  # already prepared


@torch.inference_mode()
def test_a_large_tied_head_leaves_the_embedding_row_major(large_threshold):
    torch.manual_seed(1)
    emb = torch.nn.Embedding(500, 32)
    head = torch.nn.Linear(32, 500, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2
    ids = torch.tensor([0, 7, 499, 7])
    want = emb(ids).detach().clone()
    assert prepare_cpu_head(head, CPU) == "dual"
    assert emb.weight.is_contiguous() and torch.equal(emb(ids), want)
    h = torch.randn(3, 32)
    _close(head(h), h @ emb.weight.T, h, emb.weight)


@torch.inference_mode()
def test_a_small_tied_head_reads_the_same_rows():
    torch.manual_seed(1)
    emb = torch.nn.Embedding(500, 32)
    head = torch.nn.Linear(32, 500, bias=False)
    head.weight = emb.weight
    ids = torch.tensor([0, 7, 499, 7])
    want = emb(ids).detach().clone()
    assert prepare_cpu_head(head, CPU) == "column"
    assert emb.weight.stride() == (1, 500) and torch.equal(emb(ids), want)


def test_left_alone_off_the_cpu_or_outside_float32():
    head = torch.nn.Linear(8, 16)
    assert prepare_cpu_head(head, torch.device("cuda")) is None
    assert head.weight.is_contiguous()
    half = torch.nn.Linear(8, 16).to(torch.bfloat16)
    assert prepare_cpu_head(half, CPU) is None and half.weight.is_contiguous()
    assert prepare_cpu_head(torch.nn.Identity(), CPU) is None


@pytest.mark.parametrize("rows", [1, 2, 3, 12])
def test_a_frozen_head_still_gives_the_input_its_gradient(large_threshold, rows):
    """Whatever product a row count takes, a frozen head still passes the input its gradient (the column-major
    and swapped products are torch ops autograd records; more rows take `linear`)."""
    torch.manual_seed(5)
    head = torch.nn.Linear(48, 3000, bias=True).requires_grad_(False)
    assert prepare_cpu_head(head, CPU) == "dual"
    x = torch.randn(rows, 48, requires_grad=True)
    head(x).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, head.weight.sum(0).expand(rows, 48))
