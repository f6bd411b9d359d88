"""Gradient accumulation into flat buffers and bucketed data-parallel reduction overlapped with backward.

Every parameter's gradient is added into its slice of one flat buffer (``grad_dtype``: fp32
for mixed precision, whatever the weights are) by a post-accumulate hook, which then drops the
parameter's own ``.grad``. During the step's *final* backward (the last microbatch, or under
pipeline parallelism each stage's last backward) the hook also counts down the parameter's
bucket; when a bucket's last gradient has arrived its reduction is started asynchronously, so
it runs while backward computes the gradients of earlier layers:

* plain data parallelism: an all-reduce of the bucket (every rank keeps the averaged bucket);
* ZeRO-1: each rank needs only the averaged gradients of the range whose optimizer state it
  owns; how they get there depends on the backend (:mod:`plait.data_parallel.collectives`):
  NCCL reduce-scatters the bucket into a shard-sized buffer, gloo all-reduces it in place (its
  emulated reduce-scatter is slower) and the owned shard is read from the gradient buffer itself.

Gradients are divided by the data-parallel degree before the sum, so the result is the mean.
:meth:`GradSync.finish` starts whatever has not started (buckets whose parameters received no
gradient, and the deferred buckets of tied embeddings, which are first summed over the pipeline
stages that share them) and waits for every reduction.

Under expert parallelism the buckets of routed experts (``Bucket.expert``) are summed over the
*expert-data-parallel* group (the ranks holding the same experts) and divided by the whole
data-parallel degree: an expert's gradient already holds the tokens of its whole expert group.
With ZeRO-1 they are reduce-scattered over that group into its shards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from plait.comm.primitives import GroupInfo, all_reduce
from plait.data_parallel.buckets import Bucket, BucketPlan
from plait.data_parallel.collectives import ShardCollectives, collectives_for


class GradSync:
    """Owns the flat gradient buffer of one rank and its data-parallel reduction."""

    def __init__(self, plan: BucketPlan, *, grad_dtype: torch.dtype, device: torch.device, dp: GroupInfo,
                 zero: bool, overlap: bool = True, tied: GroupInfo | None = None,
                 collectives: ShardCollectives | None = None) -> None:
        """``dp`` is the whole data-parallel group (gradients are divided by its size); each bucket
        is reduced over its own :attr:`~plait.data_parallel.buckets.Bucket.group`. ``collectives``
        forces ZeRO-1's strategy on every group (default: chosen per backend,
        :func:`~plait.data_parallel.collectives.collectives_for`)."""
        self.bucket_plan, self.dp, self.zero, self.overlap, self.tied = plan, dp, zero, overlap, tied
        self.data = torch.zeros(plan.numel, dtype=grad_dtype, device=device)
        self.views = {id(e.param): self.data[e.start:e.end] for e in plan.entries}
        self._entry = {id(e.param): e for e in plan.entries}
        if zero:
            # the reduced owned shard of each bucket: its own slice of ``data`` where the backend's
            # collective reduces in place (gloo), else a slice of one separate shard buffer
            groups = {id(b.group): b.group for b in plan.buckets}
            self._collectives = {key: collectives or collectives_for(g) for key, g in groups.items()}
            separate = [b for b in plan.buckets if not self._in_place(b)]
            self.shard_data = torch.zeros(sum(b.numel // b.shards for b in separate), dtype=grad_dtype, device=device)
            self.shard_views, at = [], 0
            for b in plan.buckets:
                size = b.numel // b.shards
                if self._in_place(b):
                    lo, hi = b.owned_range
                    self.shard_views.append(self.data[lo:hi])
                else:
                    self.shard_views.append(self.shard_data[at:at + size])
                    at += size
        self._final: set[int] = set()
        #: parameters whose slice holds this step's gradient; the others' slices are stale until
        #: written (cleared by :meth:`zero_`, zero-filled by :meth:`_clear_unwritten` if never written)
        self._written: set[int] = set()
        self._done: set[int] = set()
        self._remaining = [len(b.entries) for b in plan.buckets]
        self._launched = [False] * len(plan.buckets)
        self._works: list = []
        for e in plan.entries:
            e.param.register_post_accumulate_grad_hook(self._on_grad)

    def collectives_of(self, bucket: Bucket) -> ShardCollectives:
        """ZeRO-1's collectives on ``bucket``'s group."""
        return self._collectives[id(bucket.group)]

    def _in_place(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s reduced owned shard is its slice of the gradient buffer."""
        return self.collectives_of(bucket).reduces_in_place

    # ------------------------------------------------------------------ backward side
    def mark_final(self, modules: list[nn.Module] | None = None) -> None:
        """The next backward through ``modules`` (default: all) is the last of this step."""
        if modules is None:
            self._final = set(self._entry)
        else:
            self._final |= {id(p) for m in modules for p in m.parameters() if id(p) in self._entry}

    def mark_final_params(self, params: Iterable[torch.Tensor]) -> None:
        """The next gradient of each of ``params`` is its last of this step.

        For a split backward (zero-bubble pipelines) the runtime marks a stage's parameters in two
        groups: those whose gradients come in ``B`` before the stage's last ``B``, and the
        column/row-parallel weights whose gradients come in ``W`` before its last ``W``, so each
        bucket's reduction starts after its parameters' last ``W``, not after the last ``B``.
        """
        self._final |= {id(p) for p in params if id(p) in self._entry}

    def _on_grad(self, param: torch.Tensor) -> None:
        key = id(param)
        grad = param.grad
        if grad is None:
            # autograd runs the hook also when the backward produced no gradient for the parameter:
            # a weight whose gradient a split backward deferred to its W task (zero-bubble pipelines)
            return
        param.grad = None
        if key in self._done:
            raise RuntimeError(f"a gradient of {self._entry[key].name} arrived after its bucket was reduced; "
                               f"call mark_final() only before the step's last backward")
        if key in self._written:
            self.views[key].add_(grad.reshape(-1))
        else:  # the step's first gradient of the parameter overwrites the stale one (no memset, no add)
            self.views[key].copy_(grad.reshape(-1))
            self._written.add(key)
        if key in self._final:
            self._done.add(key)
            b = self._entry[key].bucket
            self._remaining[b] -= 1
            bucket = self.bucket_plan.buckets[b]
            if self._remaining[b] == 0 and self.overlap and not bucket.deferred:
                self._launch(bucket)

    def _clear_unwritten(self, bucket: Bucket) -> None:
        """Zero the slices of ``bucket``'s parameters that received no gradient this step."""
        for e in bucket.entries:
            if id(e.param) not in self._written:
                self.views[id(e.param)].zero_()
                self._written.add(id(e.param))

    def _launch(self, bucket: Bucket) -> None:
        self._launched[bucket.index] = True
        self._clear_unwritten(bucket)
        if self.dp.size == 1:
            return
        flat = self.data[bucket.start:bucket.end]
        flat.div_(self.dp.size)  # the whole degree, also for an expert bucket (see the module doc)
        group = bucket.group
        if group.size == 1:  # one replica per expert: its owned shard is the whole bucket
            if self.zero and not self._in_place(bucket):
                self.shard_views[bucket.index].copy_(flat)
            return
        if self.zero:
            work = self.collectives_of(bucket).reduce(flat, self.shard_views[bucket.index], group)
        else:
            work = all_reduce(flat, group.group, async_op=True)
        self._works.append(work)

    def finish(self) -> None:
        """Start every reduction not yet started (tied buckets after their stage sum) and wait for all."""
        deferred = [b for b in self.bucket_plan.buckets if b.deferred]
        if deferred and self.tied is not None and self.tied.size > 1:
            for b in deferred:
                self._clear_unwritten(b)
                all_reduce(self.data[b.start:b.end], self.tied.group)
        for b in self.bucket_plan.buckets:
            if not self._launched[b.index]:
                self._launch(b)
        for work in self._works:
            work.wait()
        self._works.clear()
        # hybrid sharding: each owned chunk holds its host's sum; add the other hosts' (same chunk)
        works = [all_reduce(self.shard_views[b.index], b.replicas.group, async_op=True)
                 for b in self.bucket_plan.buckets if b.replicas is not None]
        for work in works:
            if work is not None:
                work.wait()
        if self.zero and self.dp.size == 1 and self.shard_data.numel():
            self.shard_data.copy_(self.data)
        self._final.clear()
        self._done.clear()
        self._remaining = [len(b.entries) for b in self.bucket_plan.buckets]
        self._launched = [False] * len(self.bucket_plan.buckets)

    def zero_(self) -> None:
        """Start a new step: every gradient counts as zero. Nothing is written: a parameter's first
        gradient of the step overwrites its slice, and slices never written are zero-filled before
        their bucket is reduced (saves a pass over the buffer per step). The reduction overwrites
        the shard buffer."""
        self._written.clear()

    def reduced_view(self, start: int, end: int) -> torch.Tensor:
        """The reduced gradient of flat range ``[start, end)`` on this rank (after :meth:`finish`).

        Without ZeRO every range is available; with ZeRO only ranges inside this rank's shards.
        """
        if not self.zero:
            return self.data[start:end]
        for b in self.bucket_plan.buckets:
            lo, hi = b.owned_range
            if lo <= start and end <= hi:
                return self.shard_views[b.index][start - lo:end - lo]
        raise ValueError(f"flat range [{start}, {end}) is not owned by data-parallel rank {self.dp.rank}")
