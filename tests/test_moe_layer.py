"""The MoE building blocks against plain references: routers, dispatch plan, capacity drop
policy, the grouped matmul's backward, the whole layer (both expert paths), and the losses."""

from __future__ import annotations

import pytest
import torch

from plait.nn.moe import (
    ExpertMLP,
    MoELayer,
    MoEStats,
    SigmoidTopKRouter,
    SoftmaxTopKRouter,
    add_loss_gradient,
    expert_capacity,
    grouped_mm,
    load_balancing_loss,
    plan_dispatch,
    router_z_loss,
    update_expert_bias,
)
from plait.nn.moe import experts as experts_module


def _layer(h=16, e=4, i=8, k=2, renorm=True, seed=0, **kw) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(h, e, i, SoftmaxTopKRouter(h, e, k, renormalize=renorm), **kw)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _reference(layer: MoELayer, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: softmax, top-k, (renormalise), weighted sum of the chosen experts."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(flat @ layer.gate.weight.T, -1)
    top, idx = probs.topk(layer.top_k, -1)
    if layer.gate.renormalize:
        top = top / top.sum(-1, keepdim=True)
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros_like(flat[t])
        for j in range(layer.top_k):
            if keep is None or keep[t, j]:
                acc = acc + top[t, j] * layer.experts[str(int(idx[t, j]))](flat[t])
        rows.append(acc)
    y = torch.stack(rows)
    if hasattr(layer, "shared_expert"):
        y = y + torch.sigmoid(layer.shared_expert_gate(flat)) * layer.shared_expert(flat)
    return y.view(x.shape)


def test_softmax_router_topk_and_renormalisation():
    router = SoftmaxTopKRouter(8, 6, 2, renormalize=False)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, 8)
    r = router(x)
    probs = torch.softmax(x @ router.weight.T, -1)
    assert torch.allclose(r.probs, probs) and r.logits.dtype == torch.float32
    assert torch.equal(r.experts, probs.topk(2).indices)
    assert torch.allclose(r.weights, probs.topk(2).values)
    router.renormalize = True
    assert torch.allclose(router(x).weights.sum(-1), torch.ones(5))


def test_router_math_is_fp32_under_autocast():
    router = SoftmaxTopKRouter(8, 4, 2).to(torch.bfloat16)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = router(x)
    assert r.logits.dtype == torch.float32 and r.weights.dtype == torch.float32
    assert torch.allclose(r.logits, x.float() @ router.weight.float().T)


def test_sigmoid_router_group_limited_choice_and_bias():
    torch.manual_seed(1)
    router = SigmoidTopKRouter(8, 8, 2, num_groups=4, topk_groups=2, scale=2.5)
    torch.nn.init.normal_(router.weight)
    router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    x = torch.randn(20, 8)
    r = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    biased = scores + router.expert_bias
    for t in range(20):  # brute force: best 2 groups by their top-2 sum, then best 2 experts inside
        g = biased[t].view(4, 2).sum(-1).topk(2).indices
        allowed = torch.cat([torch.arange(2 * int(i), 2 * int(i) + 2) for i in g])
        best = allowed[biased[t, allowed].topk(2).indices]
        assert set(r.experts[t].tolist()) == set(best.tolist())
        w = scores[t, r.experts[t]]
        assert torch.allclose(r.weights[t], 2.5 * w / w.sum())  # unbiased scores, renormalised, scaled
    load = torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6])
    before = router.expert_bias.clone()
    update_expert_bias(router, load, rate=0.01)
    assert torch.allclose(router.expert_bias - before, 0.01 * torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, -1]))


def test_dispatch_plan_dropless_sorts_by_expert():
    experts = torch.tensor([[2, 0], [0, 1], [2, 3], [0, 2]])
    plan = plan_dispatch(experts, torch.rand(4, 2), 5)
    sorted_experts = experts.reshape(-1)[plan.order]
    assert sorted_experts.tolist() == [0, 0, 0, 1, 2, 2, 2, 3]
    assert plan.order.tolist() == [1, 2, 6, 3, 0, 4, 7, 5]  # stable: token order inside an expert
    assert plan.tokens.tolist() == [0, 1, 3, 1, 0, 2, 3, 2]
    assert plan.ends.tolist() == [3, 4, 7, 8, 8] and plan.ends.dtype == torch.int32
    assert plan.kept is None and int(plan.dropped) == 0


def test_capacity_keeps_the_heaviest_assignments():
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    plan = plan_dispatch(experts, weights, 3, capacity=2)
    # expert 0 gets 4 assignments (weights .6 .9 .5 .3): keeps tokens 1 and 0; expert 1 gets 3 (.4 .1 .7): keeps 3, 0
    assert plan.counts.tolist() == [2, 2, 1] and plan.routed.tolist() == [4, 3, 1] and int(plan.dropped) == 3
    kept = plan.order[plan.kept].tolist()
    assert kept == [2, 0, 6, 1, 5] and plan.ends.tolist() == [2, 4, 5]
    assert sorted(plan.order[~plan.kept].tolist()) == [3, 4, 7]
    assert expert_capacity(tokens=10, top_k=2, num_experts=8, capacity_factor=1.25) == 4


def test_grouped_matmul_backward_equals_per_group_matmuls():
    torch.manual_seed(0)
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    ends = torch.tensor([4, 4, 10], dtype=torch.int32)
    y = grouped_mm(x, w, ends)
    g = torch.randn_like(y)
    y.backward(g)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = torch.cat([xr[:4] @ wr[0], xr[4:10] @ wr[2]])
    yr.backward(g)
    assert torch.allclose(y, yr, atol=1e-6) and torch.allclose(x.grad, xr.grad, atol=1e-6)
    assert torch.allclose(w.grad, wr.grad, atol=1e-6) and not w.grad[1].any()


@pytest.mark.parametrize("hidden, inter", [(16, 8), (6, 5)], ids=["grouped_mm", "loop"])
def test_layer_equals_token_by_token_reference(hidden, inter, monkeypatch):
    calls = {"grouped": 0}
    real = experts_module._grouped

    def counting(*a):
        calls["grouped"] += 1
        return real(*a)

    monkeypatch.setattr(experts_module, "_grouped", counting)
    layer = _layer(h=hidden, i=inter, shared_intermediate_size=4, shared_expert_gate=True)
    x = torch.randn(2, 5, hidden, requires_grad=True)
    y = layer(x)
    assert calls["grouped"] == (1 if hidden == 16 else 0)
    ref_layer = _layer(h=hidden, i=inter, shared_intermediate_size=4, shared_expert_gate=True)
    xr = x.detach().clone().requires_grad_()
    yr = _reference(ref_layer, xr)
    assert torch.allclose(y, yr, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    assert torch.allclose(x.grad, xr.grad, atol=1e-5)
    for (n, p), (_, pr) in zip(layer.named_parameters(), ref_layer.named_parameters(), strict=True):
        assert torch.allclose(p.grad, pr.grad, atol=1e-5), n


def test_layer_with_capacity_drops_per_policy():
    layer = _layer(h=16, e=4, i=8, k=2)
    layer.capacity_factor = 0.5  # capacity = ceil(0.5 * 12 * 2 / 4) = 3 of the 24 assignments per expert
    x = torch.randn(1, 12, 16)
    routing, plan = layer.route(x.reshape(-1, 16))
    assert int(plan.counts.max()) <= 3 and int(plan.dropped) > 0
    keep = torch.zeros(24, dtype=torch.bool)
    keep[plan.order[plan.kept]] = True
    assert torch.allclose(layer(x), _reference(layer, x, keep.view(12, 2)), atol=1e-5)


def test_aux_loss_matches_transformers_and_balanced_value():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    logits = torch.randn(30, 8)
    probs = torch.softmax(logits, -1)
    experts = probs.topk(2).indices
    ours = load_balancing_loss(probs, experts)
    theirs = load_balancing_loss_func((logits,), 8, 2)
    assert torch.allclose(ours, theirs, atol=1e-6)
    uniform = torch.full((8, 4), 0.25)
    assert torch.allclose(load_balancing_loss(uniform, torch.arange(4).view(2, 2).repeat(4, 1)), torch.tensor(2.0))
    assert torch.allclose(router_z_loss(logits), torch.logsumexp(logits, -1).pow(2).mean())


def test_loss_gradient_equals_adding_the_scaled_loss():
    layer = _layer()
    x = torch.randn(2, 6, 16)
    layer.aux_loss_scale, layer.z_loss_scale = 0.3, 0.05
    layer.zero_grad()
    layer(x).square().sum().backward()
    injected = [p.grad.clone() for p in layer.parameters()]
    layer.aux_loss_scale = layer.z_loss_scale = 0.0
    layer.zero_grad()
    flat = x.reshape(-1, 16)
    r = layer.gate(flat)
    total = layer(x).square().sum() + 0.3 * load_balancing_loss(r.probs, r.experts) + 0.05 * router_z_loss(r.logits)
    total.backward()
    for a, p in zip(injected, layer.parameters(), strict=True):
        assert torch.allclose(a, p.grad, atol=1e-6)
    assert layer.gate.weight.grad.abs().sum() > 0
    y = torch.randn(3, requires_grad=True)
    assert add_loss_gradient(y, torch.ones(()), 0.5) is y  # a loss without a graph adds nothing


def test_stats_accumulate_on_device_in_training_only():
    layer = _layer(e=4, k=2)
    layer.stats = MoEStats.zeros(4, torch.device("cpu"))
    x = torch.randn(1, 10, 16)
    layer(x)
    layer(x)
    layer.eval()
    layer(x)
    assert layer.stats.forwards == 2 and int(layer.stats.routed.sum()) == 2 * 10 * 2
    assert layer.stats.aux > 0 and layer.stats.z > 0


def test_expert_names_follow_the_expert_class():
    class W(ExpertMLP):
        names = ("w1", "w3", "w2")

    layer = MoELayer(8, 3, 4, SoftmaxTopKRouter(8, 3, 1), expert_cls=W)
    names = [n for n, _ in layer.named_parameters()]
    assert names[:4] == ["gate.weight", "experts.0.w1.weight", "experts.0.w3.weight", "experts.0.w2.weight"]
    layer.experts.keep_only(range(1, 3))
    assert layer.experts.local_ids == [1, 2]
