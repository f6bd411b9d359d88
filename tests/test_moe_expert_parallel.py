"""Expert parallelism against one process: the dispatch plan as data, and the MoE layer at EP=2
(dropless and with a capacity) whose outputs, input gradients and expert gradients equal the
unsharded layer's on the same tokens; the router's gradient summed over the ranks equals the
reference's (each rank routes its own tokens)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from plait.mesh import ParallelMesh
from plait.moe.expert_parallel import apply_expert_parallel, receive_plan, send_positions
from plait.nn.moe import MoELayer, SoftmaxTopKRouter, plan_dispatch

TOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-5 of the reference's magnitude (the squared-output loss makes gradients O(100))."""
    return bool((a - b).abs().max() <= TOL * max(1.0, b.abs().max().item()))


def test_send_positions_put_each_peers_rows_at_the_start_of_its_slot():
    experts = torch.tensor([[3, 0], [1, 2], [3, 1]])  # 4 experts, 2 per peer at ep=2; N = 6
    plan = plan_dispatch(experts, torch.rand(3, 2), 4)
    # sorted experts: 0, 1, 1, 2, 3, 3 -> peer 0 gets rows 0..2, peer 1 rows 3..5
    assert send_positions(plan, 2).tolist() == [0, 1, 2, 6, 7, 8]
    capped = plan_dispatch(experts, torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.2, 0.8]]), 4, capacity=1)
    dest = send_positions(capped, 2)
    assert dest[capped.kept].tolist() == [0, 1, 6, 7] and (dest[~capped.kept] == 12).all()


def test_receive_plan_groups_rows_by_local_expert_valid_first():
    counts = torch.tensor([[1, 2], [0, 1]])  # peer 0 sent 1 row of local expert 0, 2 of 1; peer 1: 1 of 1
    plan = receive_plan(counts, slot=4)
    assert plan.order[:4].tolist() == [0, 1, 2, 4] and plan.ends.tolist() == [1, 4]


def _layer(capacity_factor) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(16, 4, 8, SoftmaxTopKRouter(16, 4, 2))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer.capacity_factor = capacity_factor
    return layer


def _tokens() -> torch.Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))


def _worker(rank: int, world: int) -> dict:
    return {cf: _one(rank, world, cf) for cf in (None, 0.5)}


def _one(rank: int, world: int, capacity_factor) -> tuple:
    mesh = ParallelMesh(world, rank, dp=world, ep=world)
    layer = _layer(capacity_factor)
    apply_expert_parallel([layer], mesh.info("ep"))
    assert layer.experts.local_ids == [2 * rank, 2 * rank + 1]
    x = _tokens()[rank:rank + 1].requires_grad_()
    y = layer(x)
    y.square().sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.fixture(scope="module")
def ep2_results() -> list[dict]:
    return run_distributed(_worker, 2)


@pytest.mark.slow  # two processes: 5-15 s on a busy 2-core machine
@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
def test_ep2_layer_equals_one_process(ep2_results, capacity_factor):
    results = [r[capacity_factor] for r in ep2_results]
    ref = _layer(capacity_factor)
    x = _tokens().requires_grad_()
    ys = [ref(x[r:r + 1]) for r in range(2)]  # each rank's tokens are its own micro-batch
    sum(y.square().sum() for y in ys).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for rank, (y, xg, g) in enumerate(results):
        assert _close(y, ys[rank].detach())
        assert _close(xg, x.grad[rank:rank + 1])
        experts = {n for n in g if n.startswith("experts.")}
        assert {n.split(".")[1] for n in experts} == {str(2 * rank), str(2 * rank + 1)}
        for n in experts:
            assert _close(g[n], grads[n]), n
    router = sum(g["gate.weight"] for _, _, g in results)
    assert _close(router, grads["gate.weight"])
