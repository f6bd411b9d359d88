"""The data-parallel machinery: buffer layout, bucket overlap, accumulation, precision dtypes."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from distributed import run_distributed
from plait.comm.primitives import GroupInfo
from plait.data_parallel import DistributedOptimizer, OptimizerHyper, plan_buckets
from plait.precision import policy_for

HYPER = OptimizerHyper(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
SOLO = GroupInfo(None, 0, 1)


def _params(sizes):
    return [(f"p{i}", nn.Parameter(torch.zeros(n)), True, 1.0) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_every_element_is_owned_exactly_once(shards):
    params = _params([7, 300, 5, 64, 1, 129, 33])

    def plan_of(shard):  # the plan of data-parallel rank ``shard`` (planning only: no process group)
        return plan_buckets(params, bucket_numel=100, dp=GroupInfo(None, shard, shards), sharded=True,
                            deferred_names=frozenset({"p3"}))

    plan = plan_of(0)
    assert all(b.numel % shards == 0 for b in plan.buckets)
    # buckets follow reverse registration order; the deferred parameter has a bucket of its own, last
    assert [e.name for e in plan.entries] == ["p6", "p5", "p4", "p2", "p1", "p0", "p3"]
    assert plan.buckets[-1].deferred and [e.name for e in plan.buckets[-1].entries] == ["p3"]
    assert all(len(b.entries) == 1 or sum(e.numel for e in b.entries) <= 100 for b in plan.buckets)
    owned = {}
    for shard in range(shards):
        for s in plan_of(shard).owned_segments():
            for i in range(s.start, s.end):
                assert i not in owned
                owned[i] = s.entry.name
    real = {i for e in plan.entries for i in range(e.start, e.end)}
    assert set(owned) == real
    assert plan.padding == plan.numel - len(real)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x):
        return self.layers(x).pow(2).mean()


def _overlap_worker(rank, world, overlap, zero):
    import torch.distributed as dist

    model = Tiny()
    dp = GroupInfo(dist.group.WORLD, rank, world)
    opt = DistributedOptimizer([model], policy_for("fp32"), HYPER, dp=dp, tp=SOLO, zero=zero,
                               bucket_mb=16 * 17 * 4 / 2**20, overlap=overlap)
    launched_after = []
    for mb in range(3):
        if mb == 2:
            opt.grads.mark_final()
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank * 10 + mb))).backward()
        launched_after.append(sum(opt.grads._launched))
    buckets = len(opt.bucket_plan.buckets)
    opt.grads.finish()
    grads = [opt.grads.reduced_view(s.start, s.end).clone() for s in opt.segments]
    return launched_after, buckets, grads, [(s.start, s.end) for s in opt.segments]


@pytest.mark.parametrize("zero", [False, True])
def test_buckets_reduce_during_the_last_backward_only(zero):
    """With overlap, every bucket's reduction starts inside the final backward, none earlier."""
    for overlap in (True, False):
        results = run_distributed(_overlap_worker, 2, overlap, zero)
        for launched, buckets, _, _ in results:
            assert buckets == 4
            assert launched == ([0, 0, buckets] if overlap else [0, 0, 0])
    # the reduced gradients equal the mean over ranks of the summed microbatch gradients
    model = Tiny()
    for rank in range(2):
        for mb in range(3):
            model(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank * 10 + mb))).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))]) / 2
    for _, _, grads, ranges in results:
        for g, (a, b) in zip(grads, ranges, strict=True):
            torch.testing.assert_close(g, flat[a:b], rtol=1e-6, atol=1e-7)


def test_bf16_mixed_keeps_fp32_master_and_gradients():
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    opt = DistributedOptimizer([model], policy_for("bf16-mixed"), HYPER, dp=SOLO, tp=SOLO)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.grads.data.dtype == torch.float32 and opt.master_data.dtype == torch.float32
    # the master copy starts from the exact fp32 initial values, not their bf16 rounding
    masters = torch.cat([m.reshape(-1) for m in opt.main_params])
    assert torch.equal(masters, torch.cat([b.reshape(-1) for b in reversed(before)]))
    opt.grads.mark_final()
    model(torch.randn(4, 16, dtype=torch.bfloat16)).backward()
    opt.grads.finish()
    opt.step()
    assert opt.inner.state and all(t.dtype == torch.float32 for st in opt.inner.state.values()
                                   for t in st.values() if torch.is_tensor(t) and t.dim())
    assert torch.equal(opt.param_data, torch.cat([m.reshape(-1) for m in opt.main_params]).to(torch.bfloat16))


def test_bf16_pure_keeps_everything_bf16():
    model = Tiny()
    opt = DistributedOptimizer([model], policy_for("bf16-pure"), HYPER, dp=SOLO, tp=SOLO)
    assert not opt.has_master and opt.grads.data.dtype == torch.bfloat16
    opt.grads.mark_final()
    model(torch.randn(4, 16, dtype=torch.bfloat16)).backward()
    opt.grads.finish()
    opt.step()
    assert all(t.dtype == torch.bfloat16 for st in opt.inner.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim())


def test_gradient_after_final_is_an_error_and_zero_with_dp1_warns():
    model = Tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = DistributedOptimizer([model], policy_for("fp32"), HYPER, dp=SOLO, tp=SOLO, zero=True)
    assert not opt.zero and any("ZeRO-1" in str(w.message) for w in caught)
    opt.grads.mark_final()
    model(torch.randn(2, 16)).backward()
    with pytest.raises(RuntimeError, match="arrived after its bucket was reduced"):
        model(torch.randn(2, 16)).backward()


def test_fp32_single_process_equals_torch_adamw():
    """The flat-buffer optimizer is AdamW: same values as torch's on the unflattened model."""
    ref, mine = Tiny(), Tiny()
    decay = [p for n, p in ref.named_parameters() if p.dim() > 1]
    keep = [p for n, p in ref.named_parameters() if p.dim() <= 1]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": keep, "weight_decay": 0.0}],
                                lr=HYPER.lr, betas=HYPER.betas, eps=HYPER.eps, fused=True)
    opt = DistributedOptimizer([mine], policy_for("fp32"), HYPER, dp=SOLO, tp=SOLO)
    for step in range(5):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.grads.mark_final()
        mine(x).backward()
        opt.grads.finish()
        opt.step()
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)
