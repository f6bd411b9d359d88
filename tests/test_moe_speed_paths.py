"""The expert computation's fast path: what it launches and what it leaves behind.

The grouped path must stay cheap in operations, not only correct (the layer tests check the
values): gate and up share one grouped call, and each expert weight's gradient is a contiguous
slice of one stacked gradient, kept by autograd without a further copy."""

from __future__ import annotations

import torch

from grouped_mm_calls import count_grouped_mm
from plait.nn.moe import MoELayer, SoftmaxTopKRouter
from plait.nn.moe.grouped import grouped_linear


def test_grouped_linear_equals_per_group_linear_with_weight_grads_in_linear_layout():
    torch.manual_seed(0)
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 4, 8, requires_grad=True)  # [E, out, in]
    ends = torch.tensor([4, 4, 10], dtype=torch.int32)
    y = grouped_linear(x, w, ends)
    g = torch.randn_like(y)
    y.backward(g)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = torch.cat([xr[:4] @ wr[0].T, xr[4:10] @ wr[2].T])
    yr.backward(g)
    assert torch.allclose(y, yr, atol=1e-6) and torch.allclose(x.grad, xr.grad, atol=1e-6)
    assert torch.allclose(w.grad, wr.grad, atol=1e-6) and not w.grad[1].any()
    assert w.grad.is_contiguous()


def test_grouped_experts_launch_two_calls_forward_and_keep_gradient_slices(monkeypatch):
    torch.manual_seed(0)
    layer = MoELayer(16, 4, 8, SoftmaxTopKRouter(16, 4, 2))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    calls = count_grouped_mm(monkeypatch)
    y = layer(torch.randn(2, 5, 16, requires_grad=True))
    assert len(calls) == 2, "gate and up in one grouped call, down in another"
    assert calls[0][-1] == 16 and calls[1][-1] == 8
    y.square().sum().backward()
    assert len(calls) == 2 + 4, "two calls (input and weight gradient) per forward call"
    grads = [p.grad for n, p in layer.experts.named_parameters()]
    assert all(g is not None and g.is_contiguous() for g in grads)
    # the experts' gate/up gradients are slices of one [E, 2I, H] gradient: autograd kept them, no copy
    gate_up = [layer.experts[str(e)].projections()[i].weight.grad for e in range(4) for i in (0, 1)]
    base = gate_up[0].untyped_storage().data_ptr()
    assert all(g.untyped_storage().data_ptr() == base for g in gate_up)
