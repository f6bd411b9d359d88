"""ZeRO-2 and ZeRO-3 gradients: a bucket's full gradient exists only until it is reduce-scattered.

:class:`~plait.data_parallel.grad_sync.GradSync` (plain data parallelism and ZeRO-1) keeps one
flat gradient buffer of the whole model for the whole step. Here each rank keeps only the
reduced gradient of the shards it owns (``1/dp`` of every bucket, :attr:`ShardedGradSync.shard_views`);
a bucket's full gradient is a separate tensor, taken when its first gradient of a backward
arrives and handed back as soon as its reduction has been added into the shard (a few are kept
for reuse, never more than can be in use at once).

A *round* is one backward's gradients of a bucket. A round is complete when every parameter of
the bucket has delivered its gradient; its reduction (divided by ``dp``, so the sum is the mean)
then starts at once, overlapped with the rest of backward, and at most ``max_in_flight``
reductions are outstanding, the oldest being finished (its result added into the owned shard,
its full gradient freed) before another starts. So with gradient accumulation (several
micro-batches, or pipeline micro-batches) every backward is reduce-scattered and summed into the
shard: no full gradient survives from one micro-batch to the next, at the price of one reduction
per micro-batch instead of one per step (the trade DeepSpeed's ZeRO-2 and FSDP make too).

A parameter that gets no gradient in some backward (unused in that forward) leaves its round
incomplete; the round is closed when one of its parameters delivers a second gradient (the next
backward has begun) or at :meth:`ShardedGradSync.finish`, the missing gradients counting as zero.

Deferred buckets (an embedding tied across pipeline stages) accumulate over the step's backwards
and are reduced in :meth:`~ShardedGradSync.finish`, after their sum over the stages that share them.

The collectives come from :mod:`plait.data_parallel.collectives`, chosen per backend: NCCL
reduce-scatters into a shard-sized buffer; gloo all-reduces the bucket in place and keeps its own
chunk (faster there than its emulated reduce-scatter).

``on_round_closed(bucket, complete)`` is told when a round is closed (its reduction started);
``complete`` is false for a round closed early, while the next backward through the bucket is
under way. ZeRO-3 frees a unit's gathered parameters on a complete round: its backward is over
(told at once, not when the reduction ends, which may be during the next backward).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from plait.comm.primitives import GroupInfo, all_reduce, reduce_scatter_single
from plait.data_parallel.buckets import Bucket, BucketPlan
from plait.data_parallel.collectives import Handle, ShardCollectives, collectives_for


@dataclass
class _Reduction:
    bucket: Bucket
    work: Handle | None
    result: torch.Tensor  #: this rank's chunk of the sum, once ``work`` is done
    full: torch.Tensor  #: the bucket's full gradient, kept alive while the collective reads it


class ShardedGradSync:
    """The gradient side of ZeRO-2/3 on one rank (see the module doc); the same interface as
    :class:`~plait.data_parallel.grad_sync.GradSync`."""

    zero = True

    def __init__(self, plan: BucketPlan, *, grad_dtype: torch.dtype, device: torch.device, dp: GroupInfo,
                 overlap: bool = True, tied: GroupInfo | None = None, collectives: ShardCollectives | None = None,
                 max_in_flight: int = 2,
                 on_round_closed: Callable[[Bucket, bool], None] | None = None) -> None:
        self.bucket_plan, self.dp, self.overlap, self.tied = plan, dp, overlap, tied
        self.grad_dtype, self.device, self.max_in_flight = grad_dtype, device, max(1, max_in_flight)
        self.on_round_closed = on_round_closed
        groups = {id(b.group): b.group for b in plan.buckets}
        self._collectives = {key: collectives or collectives_for(g) for key, g in groups.items()}
        #: the owned chunk of every bucket's reduced gradient, summed over the step's backwards
        self.shard_data, self.shard_views = plan.owned_chunks(grad_dtype, device)
        self._entry = {id(e.param): e for e in plan.entries}
        #: per bucket: its full gradient while a round is open (None between rounds)
        self._full: list[torch.Tensor | None] = [None] * len(plan.buckets)
        #: per bucket: the parameters that delivered a gradient in the open round
        self._arrived: list[set[int]] = [set() for _ in plan.buckets]
        #: per bucket: rounds already added into the owned shard this step (0: the shard is stale)
        self._rounds = [0] * len(plan.buckets)
        self._in_flight: deque[_Reduction] = deque()
        #: full-gradient tensors handed back after their reduction, reused by later rounds of the same
        #: size (at most ``max_in_flight + 1`` in all, the oldest dropped first: about what can be
        #: alive at once anyway), so a step does not allocate, and page-fault, fresh bucket-sized
        #: memory for every round
        self._spare: deque[torch.Tensor] = deque()
        for e in plan.entries:
            e.param.register_post_accumulate_grad_hook(self._on_grad)

    def collectives_of(self, bucket: Bucket) -> ShardCollectives:
        return self._collectives[id(bucket.group)]

    # ------------------------------------------------------------------ backward side
    def mark_final(self, modules: list[nn.Module] | None = None) -> None:
        """Nothing to do: every backward's rounds are reduced (kept for the runtime's hooks)."""

    def mark_final_params(self, params: Iterable[torch.Tensor]) -> None:
        """Nothing to do (see :meth:`mark_final`)."""

    def _on_grad(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:  # a weight whose gradient a split backward deferred to its W task
            return
        param.grad = None
        key = id(param)
        e = self._entry[key]
        b = self.bucket_plan.buckets[e.bucket]
        repeat = key in self._arrived[b.index]
        if repeat and not b.deferred:  # a new backward began before the round completed: close it
            self._reduce(b, complete=False)
            repeat = False
        self._finish_bucket(b)  # its previous reduction still reads the buffer about to be written
        full = self._full[b.index]
        if full is None:
            full = self._full[b.index] = self._take(b.numel)
        view = full[e.start - b.start:e.end - b.start]
        if repeat:  # deferred buckets accumulate over the step
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
        self._arrived[b.index].add(key)
        if self.overlap and not b.deferred and len(self._arrived[b.index]) == len(b.entries):
            self._reduce(b, complete=True)

    def _open_buffer(self, b: Bucket) -> torch.Tensor:
        """The bucket's full gradient with every slice not delivered this round zero-filled."""
        full = self._full[b.index]
        if full is None:
            full = self._full[b.index] = self._take(b.numel).zero_()
            return full
        arrived = self._arrived[b.index]
        for e in b.entries:
            if id(e.param) not in arrived:
                full[e.start - b.start:e.end - b.start].zero_()
        padding = b.end - b.entries[-1].end  # what makes the bucket split evenly into shards
        if padding:
            full[b.numel - padding:].zero_()
        return full

    def _reduce(self, b: Bucket, *, complete: bool) -> None:
        """Close bucket ``b``'s round and start its reduction."""
        full = self._open_buffer(b)
        self._full[b.index] = None
        self._arrived[b.index].clear()
        if self.on_round_closed is not None:
            self.on_round_closed(b, complete)
        full.div_(self.dp.size)  # the whole degree, also for an expert bucket (see GradSync)
        group = b.group
        if group.size == 1:  # one replica per expert: the owned chunk is the whole bucket
            self._in_flight.append(_Reduction(b, None, full, full))
        else:
            coll = self.collectives_of(b)
            size = b.numel // b.shards
            if coll.reduces_in_place:
                work = all_reduce(full, group.group, async_op=True)
                result = full[b.shard * size:(b.shard + 1) * size]
            else:
                result = torch.empty(size, dtype=self.grad_dtype, device=self.device)
                work = reduce_scatter_single(result, full, group=group.group, async_op=True)
            self._in_flight.append(_Reduction(b, work, result, full))
        while len(self._in_flight) > self.max_in_flight:
            self._complete(self._in_flight.popleft())

    def _finish_bucket(self, b: Bucket) -> None:
        """Finish every reduction up to and including the last one of bucket ``b`` still in flight."""
        if not any(r.bucket is b for r in self._in_flight):
            return
        while self._in_flight:
            r = self._in_flight.popleft()
            self._complete(r)
            if r.bucket is b and not any(q.bucket is b for q in self._in_flight):
                return

    def _complete(self, r: _Reduction) -> None:
        if r.work is not None:
            r.work.wait()
        if r.bucket.replicas is not None:  # hybrid sharding: the host's sum, then the other hosts'
            all_reduce(r.result, r.bucket.replicas.group)
        shard = self.shard_views[r.bucket.index]
        if self._rounds[r.bucket.index] == 0:
            shard.copy_(r.result)
        else:
            shard.add_(r.result)
        self._rounds[r.bucket.index] += 1
        self._spare.append(r.full)
        while len(self._spare) > self.max_in_flight + 1:
            self._spare.popleft()

    def _take(self, numel: int) -> torch.Tensor:
        """An uninitialised full-gradient tensor of ``numel`` elements (a spare one if there is)."""
        for i, t in enumerate(self._spare):
            if t.numel() == numel:
                del self._spare[i]
                return t
        return torch.empty(numel, dtype=self.grad_dtype, device=self.device)

    def finish(self) -> None:
        """Close every open round (deferred buckets after their sum over the tied stages), reduce the
        buckets that received nothing this step (as zeros, so every rank runs the same collectives),
        and wait for all; afterwards :meth:`reduced_view` holds the step's averaged gradients."""
        for b in self.bucket_plan.buckets:
            if b.deferred and self.tied is not None and self.tied.size > 1:
                all_reduce(self._open_buffer(b), self.tied.group)
                # every slice now holds the stages' sum: none may be zero-filled again below
                self._arrived[b.index].update(id(e.param) for e in b.entries)
        for b in self.bucket_plan.buckets:
            pending = any(r.bucket is b for r in self._in_flight)
            if self._arrived[b.index] or (self._rounds[b.index] == 0 and not pending):
                self._reduce(b, complete=True)
        while self._in_flight:
            self._complete(self._in_flight.popleft())

    def zero_(self) -> None:
        """Start a new step: the owned shards count as zero until the step's first round lands."""
        self._rounds = [0] * len(self.bucket_plan.buckets)

    def reduced_view(self, start: int, end: int) -> torch.Tensor:
        """The reduced gradient of flat range ``[start, end)``, which must lie in an owned chunk."""
        for b in self.bucket_plan.buckets:
            lo, hi = b.owned_range
            if lo <= start and end <= hi:
                return self.shard_views[b.index][start - lo:end - lo]
        raise ValueError(f"flat range [{start}, {end}) is not owned by data-parallel rank {self.dp.rank}")
