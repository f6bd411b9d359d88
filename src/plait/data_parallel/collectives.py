"""Which collectives ZeRO-1 uses to reduce a gradient bucket into shards and to gather the updated
parameter shards, chosen per backend.

Why per backend: the two backends implement the same primitives very differently. NCCL has
native ring reduce-scatter and all-gather, which move ``(n-1)/n`` of a bucket per rank, the least
possible, so ZeRO-1 costs the same traffic as one all-reduce. Gloo (CPU) has no native
reduce-scatter: ``reduce_scatter_tensor`` is emulated and, like ``all_gather_into_tensor``, is far
slower than its all-reduce. Measured on 2 gloo ranks (2-core CPU, one 84 MiB fp32 buffer, see
``bench/bench_dp.py``): all-reduce 64 ms, reduce-scatter 115 ms, all-gather 93 ms, but one
broadcast per owner of its shard 31-37 ms. So on gloo:

* the gradient bucket is **all-reduced in place**: the owned shard of the reduced bucket is then
  simply its slice of the gradient buffer (no separate shard buffer, no copy), and the all-reduce
  is cheaper than gloo's reduce-scatter although it moves more data;
* the updated parameters are published by **one broadcast per owner** of its shard, straight from
  the parameter buffer (no staging copy: a broadcast's source and destination are the same slice).

Every other backend (NCCL, and whatever else) keeps reduce-scatter into a shard buffer and
all-gather from a staged copy of the owned shard, the primitives it is built for.

Both strategies give the owner the same sum of the same terms; with two ranks the sums are
bitwise equal (a + b == b + a), with more ranks the order of the additions may differ between
the algorithms (round-off only).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from plait.comm.primitives import GroupInfo, all_gather_single, all_reduce, reduce_scatter_single


class Handle(Protocol):
    """A started collective (a ``torch.distributed`` work handle or :class:`_KeepAlive`)."""

    def wait(self) -> object: ...


class ShardCollectives:
    """ZeRO-1's two data-parallel collectives on one bucket (base: reduce-scatter / all-gather)."""

    #: the reduced owned shard of a bucket lives in the gradient buffer itself (no shard buffer)
    reduces_in_place = False

    def reduce(self, bucket: torch.Tensor, shard: torch.Tensor, group: GroupInfo) -> Handle | None:
        """Start summing ``bucket`` over ``group`` so that this rank's ``1/n`` chunk of the sum ends
        in ``shard`` (the chunk's own slice of ``bucket`` when :attr:`reduces_in_place`); returns the
        work handle (``None`` for a one-rank group)."""
        return reduce_scatter_single(shard, bucket, group=group.group, async_op=True)

    def gather(self, bucket: torch.Tensor, group: GroupInfo) -> list[Handle]:
        """Start filling every chunk of ``bucket`` from its owner (this rank's chunk already holds
        its updated values); returns the work handles."""
        size = bucket.numel() // group.size
        src = bucket[group.rank * size:(group.rank + 1) * size].clone()  # input and output must not overlap
        work = all_gather_single(bucket, src, group=group.group, async_op=True)
        return [_KeepAlive(work, src)]


class GlooShardCollectives(ShardCollectives):
    """All-reduce in place, then one broadcast per owner (see the module doc for the measurements)."""

    reduces_in_place = True

    def reduce(self, bucket: torch.Tensor, shard: torch.Tensor, group: GroupInfo) -> Handle | None:
        return all_reduce(bucket, group.group, async_op=True)

    def gather(self, bucket: torch.Tensor, group: GroupInfo) -> list[Handle]:
        size = bucket.numel() // group.size
        pg = group.group
        assert pg is not None, "a bucket is gathered only over a group of several ranks"
        return [dist.broadcast(bucket[r * size:(r + 1) * size], src=dist.get_global_rank(pg, r),
                               group=pg, async_op=True) for r in range(group.size)]


class _KeepAlive:
    """A work handle that keeps the collective's input tensor alive until it is waited for."""

    __slots__ = ("src", "work")

    def __init__(self, work: Handle, src: torch.Tensor) -> None:
        self.work = work
        self.src: torch.Tensor | None = src

    def wait(self) -> None:
        self.work.wait()
        self.src = None


def collectives_for(group: GroupInfo) -> ShardCollectives:
    """The strategy for ``group``'s backend (gloo: all-reduce + broadcasts; otherwise reduce-scatter
    + all-gather). A one-rank group or one without a process group never communicates."""
    if group.size > 1 and group.group is not None and dist.get_backend(group.group) == "gloo":
        return GlooShardCollectives()
    return ShardCollectives()
