"""ZeRO-1's per-backend collectives: on gloo the in-place all-reduce and per-owner broadcasts train
exactly like reduce-scatter + all-gather, and like plain data parallelism; so does leaving the
parameter gathers in flight into the next forward (``prefetch_params``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_distributed
from plait.comm.primitives import GroupInfo
from plait.data_parallel import DistributedOptimizer, OptimizerHyper
from plait.data_parallel.collectives import GlooShardCollectives, ShardCollectives, collectives_for
from plait.precision import policy_for

HYPER = OptimizerHyper(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


class Net(nn.Module):
    """Uneven parameter sizes (odd bias, norm) so buckets need padding and shards split parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 17)
        self.norm = nn.LayerNorm(17)
        self.b = nn.Linear(17, 9)

    def forward(self, x):
        return self.b(self.norm(self.a(x))).square().mean()


def _train(rank, world, preset, zero, collectives, steps=4, prefetch=False):
    import torch.distributed as dist

    model = Net()
    dp = GroupInfo(dist.group.WORLD, rank, world)
    solo = GroupInfo(None, 0, 1)
    opt = DistributedOptimizer([model], policy_for(preset), HYPER, dp=dp, tp=solo, zero=zero,
                               bucket_mb=100 * 4 / 2**20, collectives=collectives, prefetch_params=prefetch)
    for step in range(steps):
        for mb in range(2):
            if mb == 1:
                opt.grads.mark_final()
            x = torch.randn(6, 12, generator=torch.Generator().manual_seed(100 * step + 10 * rank + mb))
            model(x.to(model.a.weight.dtype)).float().backward()
        opt.grads.finish()
        opt.clip_(opt.grad_norm(), 0.5)
        opt.step()
        if prefetch:  # the gathers are left in flight; each module's forward pre-hook awaits its buckets
            assert len(opt._pending) == len(opt.bucket_plan.buckets)
    if prefetch:  # state_dict() awaits every gather
        return {n: p.float().clone() for n, p in model.state_dict().items()}, opt
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}, opt


def _worker(rank, world, preset):
    import torch.distributed as dist

    chosen = collectives_for(GroupInfo(dist.group.WORLD, rank, world))
    plain, _ = _train(rank, world, preset, zero=False, collectives=None)
    auto, opt = _train(rank, world, preset, zero=True, collectives=None)
    forced, forced_opt = _train(rank, world, preset, zero=True, collectives=ShardCollectives())
    prefetched, _ = _train(rank, world, preset, zero=True, collectives=None, prefetch=True)
    return {"chosen": type(chosen).__name__, "plain": plain, "auto": auto, "forced": forced, "prefetched": prefetched,
            "buckets": len(opt.bucket_plan.buckets), "padding": opt.bucket_plan.padding,
            "shard_buffer": opt.grads.shard_data.numel(), "forced_shard_buffer": forced_opt.grads.shard_data.numel(),
            "in_place": all(v.untyped_storage().data_ptr() == opt.grads.data.untyped_storage().data_ptr()
                            for v in opt.grads.shard_views)}


@pytest.mark.parametrize("preset", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_gloo_zero1_trains_like_reduce_scatter_all_gather_and_like_plain_dp(preset):
    results = run_distributed(_worker, 2, preset)
    for r in results:
        assert r["chosen"] == GlooShardCollectives.__name__
        assert r["buckets"] >= 3 and r["padding"] > 0, "the layout must exercise padding and several buckets"
        # gloo reduces in place: no separate shard buffer; forced reduce-scatter needs one
        assert r["in_place"] and r["shard_buffer"] == 0 < r["forced_shard_buffer"]
        for name, w in r["auto"].items():
            # two ranks: both algorithms add the same two numbers, so the results are bitwise equal
            assert torch.equal(w, r["forced"][name]), name
            # gathers left in flight into the next forward: the same weights (every forward waited)
            assert torch.equal(w, r["prefetched"][name]), name
            # plain DP sums the squared-gradient norm in another order (the clip factor differs in
            # the last bit) and steps one flat run instead of one per shard (tests/test_fused_adamw.py):
            # round-off only, a few fp32 ulps after 4 steps; a bf16 weight can round to its neighbour
            torch.testing.assert_close(w, r["plain"][name], rtol=1e-6 if preset == "fp32" else 2**-7, atol=1e-7,
                                       msg=name)
    for name, w in results[0]["auto"].items():  # every replica holds the whole updated model
        assert torch.equal(w, results[1]["auto"][name]), name


def test_single_rank_group_uses_the_default_collectives():
    assert type(collectives_for(GroupInfo(None, 0, 1))) is ShardCollectives
