"""The output head stored column-major on a CPU: same values, same batched logits, tied embeddings follow."""
from __future__ import annotations

import torch

from omni.engine.output_head import use_column_major_head
from tests.tolerances import reorder_atol

CPU = torch.device("cpu")


@torch.inference_mode()
def test_same_values_column_major_and_the_same_logits():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False)
    before = head.weight.detach().clone()
    x = torch.randn(8, 64)
    want = head(x)
    param = head.weight
    assert use_column_major_head(head, CPU) is True
    assert head.weight is param  # the same parameter: a tied embedding follows
    assert head.weight.stride() == (1, 1000) and torch.equal(head.weight, before)
    # Each logit is one 64-term dot product; the two layouts only sum it in another order: per logit,
    # within reorder_atol(64, sum_k |x_k * w_k|) of each other (tests/tolerances.py).
    atol = torch.tensor(reorder_atol(64, 1.0)) * (x.abs() @ before.abs().T)
    for rows in (1, 2, 8):
        assert ((head(x[:rows]) - want[:rows]).abs() <= atol[:rows]).all()
        assert torch.equal(head(x[:rows]).argmax(-1), want[:rows].argmax(-1))
    assert use_column_major_head(head, CPU) is False  # already column-major


def test_a_tied_embedding_reads_the_same_rows():
    torch.manual_seed(1)
    emb = torch.nn.Embedding(500, 32)
    head = torch.nn.Linear(32, 500, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2
    ids = torch.tensor([0, 7, 499, 7])
    want = emb(ids).detach().clone()
    assert use_column_major_head(head, CPU) is True
    assert emb.weight.stride() == (1, 500) and torch.equal(emb(ids), want)


def test_left_alone_off_the_cpu_or_outside_float32():
    head = torch.nn.Linear(8, 16)
    assert use_column_major_head(head, torch.device("cuda")) is False
    assert head.weight.is_contiguous()
    half = torch.nn.Linear(8, 16).to(torch.bfloat16)
    assert use_column_major_head(half, CPU) is False and half.weight.is_contiguous()
    assert use_column_major_head(torch.nn.Identity(), CPU) is False
