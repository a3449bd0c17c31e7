"""A decoder's linears packed for oneDNN on a CPU: the same products within summation reordering, at every
row count and input shape, with and without bias; parameters untouched; applied only where it can be."""
from __future__ import annotations

import pytest
import torch

from omni.engine.runner import cpu_linear
from omni.engine.runner.cpu_linear import pack_cpu_linears
from tests.tolerances import reorder_atol

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, layer: torch.nn.Linear) -> None:
    # Each output is one K-term dot product (plus the bias) summed in another order: within
    # reorder_atol(K, sum_k |x_k * w_k|) of F.linear's (tests/tolerances.py).
    atol = torch.tensor(reorder_atol(x.shape[-1], 1.0)) * (x.abs() @ layer.weight.abs().T) + 1e-6
    assert got.shape == want.shape
    assert ((got - want).abs() <= atol).all()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(64, 96, bias=True)
        self.up = torch.nn.Linear(64, 160, bias=False)
        self.norm = torch.nn.LayerNorm(64)


@needs_onednn
@torch.inference_mode()
def test_packed_linears_compute_what_f_linear_does():
    torch.manual_seed(0)
    block = _Block()
    state = {k: v.clone() for k, v in block.state_dict().items()}
    params = {k: v for k, v in block.named_parameters()}
    x = torch.randn(2, 70, 64)
    want = {name: getattr(block, name)(x) for name in ("q", "up")}
    assert pack_cpu_linears(block, CPU) == 2  # the two linears; the norm is not one
    assert {k: v for k, v in block.named_parameters()} == params  # the same parameter objects
    assert block.state_dict().keys() == state.keys()  # nothing packed is saved or loaded
    assert all(torch.equal(block.state_dict()[k], v) for k, v in state.items())
    for name in ("q", "up"):
        layer = getattr(block, name)
        assert layer._omni_packed is not None
        _close(layer(x), want[name], x, layer)  # a 3-D input, as transformers passes
        for rows in (1, 2, 5, 16, 32, 33, 140):  # decode batches, odd sizes, a prefill chunk
            flat = x.reshape(-1, 64)[:rows]
            _close(layer(flat), torch.nn.functional.linear(flat, layer.weight, layer.bias), flat, layer)
        assert layer(x[:, :0]).shape == (2, 0, layer.out_features)
    assert pack_cpu_linears(block, CPU) == 0  # already packed


@needs_onednn
def test_gradients_and_other_dtypes_take_the_plain_product():
    torch.manual_seed(1)
    layer = torch.nn.Linear(32, 48)
    assert pack_cpu_linears(layer, CPU) == 1
    x = torch.randn(3, 32, requires_grad=True)
    layer(x).sum().backward()  # training still works: F.linear, with its gradients
    assert layer.weight.grad is not None and x.grad is not None
    # Frozen weights, a gradient for the input (the packed op has no backward): F.linear's gradient too.
    layer.requires_grad_(False)
    x.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, 32))
    with torch.inference_mode():
        half = torch.randn(3, 32, dtype=torch.float64)
        assert layer(half.float()).dtype == torch.float32
        with pytest.raises(RuntimeError):  # another dtype than the weight's fails as F.linear does
            layer(half)


def test_packing_applies_only_where_it_can(monkeypatch):
    plain = torch.nn.Linear(16, 16)
    assert pack_cpu_linears(plain, torch.device("cuda")) == 0  # a GPU's cuBLAS reads any layout
    assert pack_cpu_linears(torch.nn.Linear(16, 16).to(torch.bfloat16), CPU) == 0  # float32 only

    class Custom(torch.nn.Linear):  # a subclass with its own forward (a quantized or LoRA layer) keeps it
        def forward(self, x):
            return super().forward(x) * 2

    assert pack_cpu_linears(Custom(16, 16), CPU) == 0
    monkeypatch.setenv("OMNI_CPU_PACKED_LINEAR", "0")
    assert pack_cpu_linears(plain, CPU) == 0 and "forward" not in vars(plain)


def test_a_torch_without_the_op_keeps_f_linear(monkeypatch, caplog):
    def missing(weight):
        raise AttributeError("no mkldnn::_reorder_linear_weight")

    monkeypatch.setattr(cpu_linear, "pack_weight", missing)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    layer = torch.nn.Linear(8, 8)
    with caplog.at_level("WARNING"):
        assert pack_cpu_linears(layer, CPU) == 0
    assert "forward" not in vars(layer) and "packing unavailable" in caplog.text
    x = torch.randn(2, 8)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_a_causal_lm_stage_packs_its_decoder_not_its_head(tiny_qwen2):
    from stages.causal_lm import CausalLMStage

    stage = CausalLMStage.load(tiny_qwen2, dtype=torch.float32, device=CPU)
    layers = [m for m in stage.decoder.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(getattr(m, "_omni_packed", None) is not None for m in layers)
    assert getattr(stage.lm_head, "_omni_packed", None) is None  # the head has its own (output_head.py)


@needs_onednn
def test_a_copy_the_free_memory_cannot_spare_is_not_made(monkeypatch, caplog):
    block = _Block()  # 64 x 96 + 64 x 160 float32 weights: 65,536 bytes
    monkeypatch.setattr(cpu_linear, "host_available", lambda: (200_000, "test"))
    with caplog.at_level("WARNING"):
        assert pack_cpu_linears(block, CPU) == 0  # 65,536 bytes > a quarter of 200,000
    assert "not packing 2 linear weights" in caplog.text and "forward" not in vars(block.q)
    monkeypatch.setattr(cpu_linear, "host_available", lambda: (300_000, "test"))
    assert pack_cpu_linears(block, CPU) == 2
    monkeypatch.setattr(cpu_linear, "host_available", lambda: (None, "unknown"))  # unknown: packed
    assert pack_cpu_linears(_Block(), CPU) == 2

