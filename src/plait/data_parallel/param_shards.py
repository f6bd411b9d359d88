"""ZeRO-3 parameters: each rank keeps its owned chunk of every bucket; a unit's weights are gathered
only while its forward or backward runs.

A *unit* is one decoder block (``...layers.<i>``) of a stage module, or the stage's *root*: every
parameter outside its blocks (embedding, final norm, head). Buckets never span units
(:func:`plait.data_parallel.buckets.plan_buckets` with ``unit_of``), so a unit is a few buckets
gathered and freed together, one all-gather (or, on gloo, one broadcast per owner) each.

Lifetime of a block's weights in a training step:

* **forward**: a forward pre-hook gathers the block (waiting for its prefetch if one is in
  flight) and starts the gather of the next block of the stage, so that gather overlaps this
  block's compute; after the forward the block is freed (``reshard_after_forward``) or kept;
* **backward**: a hook on the block's output gradient gathers it again before its backward
  (again prefetching the previous block); under activation checkpointing the recomputation then
  finds it gathered; when the last gradient of a bucket has been reduced
  (:class:`~plait.data_parallel.sharded_grads.ShardedGradSync` calls back when it closes the
  round), the bucket is freed;
* the root is gathered at the start of the stage's forward and kept until the step's update
  (it holds the embedding and head, needed at both ends of forward and backward).

Forwards without gradient (evaluation, generation, a frozen reference) free every unit, root
included, as soon as it has run. A freed parameter's ``.data`` is an empty tensor, so an
accidental read outside a forward fails on its shape instead of returning stale values; reads
outside a forward go through :meth:`ShardedParams.gathered`.

Each bucket's gathered weights live in one tensor whose storage is resized to the bucket at every
gather and to nothing at every release (what autograd saved from it in forward, such as the
``weight.t()`` view ``F.linear`` keeps, reads the weights again once the bucket is gathered for
backward), and each parameter's ``.data`` is a view of it while gathered and an empty tensor
otherwise: the parameter keeps its identity and autograd version, and a stray read of a freed
parameter fails on its shape instead of reading freed memory (a view of a resized-away storage
crashes the process on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.activation_checkpointing import decoder_blocks
from plait.data_parallel.buckets import Bucket, BucketPlan, ParamEntry
from plait.data_parallel.collectives import Handle, ShardCollectives

#: elements of a parameter filled at once when adopting (the multiples of it from the parameter's
#: start are the initialisation's block boundaries when a row divides it: each block drawn once)
ADOPT_WINDOW = 1 << 22


@dataclass
class Unit:
    """A set of parameters gathered together: one decoder block, or a stage's root."""

    index: int
    module: nn.Module
    root: bool
    stage: int
    #: the unit's position among its stage's blocks (forward order); -1 for a root
    position: int
    buckets: list[Bucket] = field(default_factory=list)


def plan_units(modules: list[nn.Module]) -> tuple[list[Unit], dict[str, int]]:
    """The units of a rank's stage modules and each parameter's unit (frozen ones too), keyed by the
    name the optimizer gives it (first holder wins, as in
    :class:`~plait.data_parallel.optimizer.DistributedOptimizer`)."""
    units: list[Unit] = []
    unit_of: dict[str, int] = {}
    seen: set[int] = set()
    for si, module in enumerate(modules):
        root = Unit(len(units), module, True, si, -1)
        units.append(root)
        owner: dict[int, int] = {}
        for position, (_, block) in enumerate(decoder_blocks(module)):
            unit = Unit(len(units), block, False, si, position)
            units.append(unit)
            for p in block.parameters():
                owner.setdefault(id(p), unit.index)
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            unit_of[name] = owner.get(id(p), root.index)
    return units, unit_of


class ShardedParams:
    """The ZeRO-3 parameter side of one rank (see the module doc)."""

    def __init__(self, plan: BucketPlan, units: list[Unit], *, dtype: torch.dtype, device: torch.device,
                 collectives_of: Callable[[Bucket], ShardCollectives], reshard_after_forward: bool = True,
                 frozen_plan: BucketPlan | None = None) -> None:
        self.bucket_plan, self.units, self.dtype, self.device = plan, units, dtype, device
        self.collectives_of, self.reshard_after_forward = collectives_of, reshard_after_forward
        #: frozen parameters (LoRA's base), sharded and gathered like the rest but never updated:
        #: their buckets come after the trained ones, in their own dtype
        self.frozen_plan = frozen_plan if frozen_plan is not None and frozen_plan.buckets else None
        frozen = self.frozen_plan.buckets if self.frozen_plan is not None else []
        self._all = list(plan.buckets) + frozen
        #: every bucket's slot in the per-bucket lists (its index among the trained, then the frozen)
        self._slot = {id(b): i for i, b in enumerate(self._all)}
        self._frozen_of: dict[int, list[Bucket]] = {}
        for b in self._all:
            units[b.unit].buckets.append(b)
        for b in frozen:
            self._frozen_of.setdefault(b.unit, []).append(b)
        #: the owned chunk of every bucket, in the weights' dtype: what the gathers send
        self.shard_data, self.shard_views = plan.owned_chunks(dtype, device)
        frozen_dtype = frozen[0].entries[0].param.dtype if frozen else dtype
        self.frozen_data, frozen_views = (self.frozen_plan.owned_chunks(frozen_dtype, device)
                                          if self.frozen_plan is not None else (torch.empty(0), []))
        self._views = list(self.shard_views) + list(frozen_views)
        #: per bucket, the tensor its gathered weights live in: allocated at each gather and given
        #: back at each release by resizing its storage, the same storage every time, so that what
        #: autograd saved from it in forward (``F.linear`` keeps ``weight.t()``, a view of it) reads
        #: the weights again once the bucket is gathered for backward, and frees them in between
        self._buffers: list[torch.Tensor] = []
        for b in self._all:
            buf = torch.empty(b.numel, dtype=self._views[self._slot[id(b)]].dtype, device=device)
            buf.untyped_storage().resize_(0)
            self._buffers.append(buf)
        self._live = [False] * len(self._all)
        self._pending: dict[int, list[Handle]] = {}
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self._frozen_empty = torch.empty(0, dtype=frozen_dtype, device=device)
        self._blocks: dict[int, list[Unit]] = {}
        for u in units:
            if not u.root:
                self._blocks.setdefault(u.stage, []).append(u)
        self._hooks: list[Any] = []
        #: every parameter's local shape (a freed parameter's own is ``(0,)``)
        self._shapes = {id(e.param): e.param.shape for b in self._all for e in b.entries}

    # ------------------------------------------------------------------ construction
    @torch.no_grad()
    def adopt(self, fill: Callable[[ParamEntry, int, int, torch.Tensor], None]) -> None:
        """Fill the owned chunks through ``fill(entry, a, z, dest)``, which writes flat buffer elements
        ``[a, z)`` of a parameter's value into ``dest`` (read from the whole local weights the model
        was built with, or computed for this range only from a deferred build), then free the
        parameters: from here on each exists only as its owner's chunk."""
        def whole(e: ParamEntry, a: int, z: int, dest: torch.Tensor) -> None:
            dest.copy_(e.param.detach().reshape(-1)[a - e.start:z - e.start])

        trained = len(self.bucket_plan.buckets)
        for b in self._all:  # the frozen base (after the trained buckets) is always built whole
            read = fill if self._slot[id(b)] < trained else whole
            lo, hi = b.owned_range
            chunk = self._views[self._slot[id(b)]]
            chunk.zero_()  # padding
            for e in b.entries:
                a = max(lo, e.start)
                while a < min(hi, e.end):  # in windows: a deferred build computes one window at a time
                    z = min(hi, e.end, e.start + ((a - e.start) // ADOPT_WINDOW + 1) * ADOPT_WINDOW)
                    read(e, a, z, chunk[a - lo:z - lo])
                    a = z
        for b in self._all:
            for e in b.entries:
                e.param.data = self._freed(b)

    def _freed(self, b: Bucket) -> torch.Tensor:
        """What a freed parameter of ``b`` points at: an empty tensor of its dtype."""
        return self._empty if self._slot[id(b)] < len(self.bucket_plan.buckets) else self._frozen_empty

    def register_hooks(self) -> None:
        """The forward and pre-backward hooks that gather and free the units.

        A compiled block (``train.compile``) runs its hooks inside its compiled call; they are kept
        out of the graph (``torch.compiler.disable``): swapping ``param.data`` is not traceable."""
        before, after = torch.compiler.disable(self._before_forward), torch.compiler.disable(self._after_forward)
        for u in self.units:
            if not u.buckets:
                continue
            self._hooks.append(u.module.register_forward_pre_hook(
                lambda _m, args, kwargs, u=u: before(u, args, kwargs), with_kwargs=True))
            self._hooks.append(u.module.register_forward_hook(lambda _m, _a, out, u=u: after(u, out)))

    # ------------------------------------------------------------------ gathering and freeing
    def local_shape(self, param: torch.Tensor) -> torch.Size:
        """``param``'s local shape, also while it is freed (its own shape is then ``(0,)``)."""
        return self._shapes.get(id(param), param.shape)

    def owned_values(self, b: Bucket) -> torch.Tensor:
        return self._views[self._slot[id(b)]]

    def _gather(self, b: Bucket) -> None:
        """Start filling bucket ``b``'s weights from their owners (nothing if already gathered)."""
        if self._live[self._slot[id(b)]]:
            return
        full = self._buffers[self._slot[id(b)]]
        full.untyped_storage().resize_(b.numel * full.element_size())
        size = b.numel // b.shards
        full[b.shard * size:(b.shard + 1) * size].copy_(self._views[self._slot[id(b)]])
        if b.group.size > 1:
            self._pending[self._slot[id(b)]] = self.collectives_of(b).gather(full, b.group)
        self._live[self._slot[id(b)]] = True
        for e in b.entries:
            e.param.data = full[e.start - b.start:e.end - b.start].view(self._shapes[id(e.param)])

    def _wait(self, b: Bucket) -> None:
        for work in self._pending.pop(self._slot[id(b)], ()):
            work.wait()

    def gather_unit(self, u: Unit, *, wait: bool = True) -> None:
        for b in u.buckets:
            self._gather(b)
        if wait:
            for b in u.buckets:
                self._wait(b)

    def release(self, b: Bucket) -> None:
        """Free bucket ``b``'s gathered weights (the owned chunk stays)."""
        if not self._live[self._slot[id(b)]]:
            return
        self._wait(b)
        for e in b.entries:
            e.param.data = self._freed(b)
        self._buffers[self._slot[id(b)]].untyped_storage().resize_(0)
        self._live[self._slot[id(b)]] = False

    def release_unit(self, u: Unit) -> None:
        for b in u.buckets:
            self.release(b)

    def release_all(self) -> None:
        for b in self._all:
            self.release(b)

    def gathered_buckets(self) -> int:
        """How many buckets are gathered now (for tests and memory reports)."""
        return sum(self._live)

    @contextmanager
    def gathered(self, *, write_back: bool = False) -> Iterator[None]:
        """Every weight gathered for reads outside a forward (checkpoints, export); with
        ``write_back`` the owned chunks are taken from the weights afterwards (after loading them)."""
        for u in self.units:
            self.gather_unit(u)
        try:
            yield
        finally:
            if write_back:
                self._take_owned()
            self.release_all()

    @torch.no_grad()
    def _take_owned(self, buckets: list[Bucket] | None = None) -> None:
        for b in self.bucket_plan.buckets if buckets is None else buckets:  # the frozen ones never change
            slot = self._slot[id(b)]
            if self._live[slot]:
                size = b.numel // b.shards
                self._views[slot].copy_(self._buffers[slot][b.shard * size:(b.shard + 1) * size])

    @contextmanager
    def bucket_gathered(self, b: Bucket, *, write_back: bool = False) -> Iterator[None]:
        """Bucket ``b``'s weights gathered for the duration (collective over its group); with
        ``write_back`` its owned chunk is taken from them afterwards (after loading them)."""
        was = self._live[self._slot[id(b)]]
        self._gather(b)
        self._wait(b)
        try:
            yield
        finally:
            if write_back:
                self._take_owned([b])
            if not was:
                self.release(b)

    # ------------------------------------------------------------------ hooks
    def _neighbour(self, u: Unit, step: int) -> Unit | None:
        blocks = self._blocks.get(u.stage, [])
        at = u.position + step
        return blocks[at] if 0 <= at < len(blocks) else None

    def _before_forward(self, u: Unit, args: tuple = (), kwargs: dict | None = None) -> None:
        self.gather_unit(u)
        if u.index in self._frozen_of and torch.is_grad_enabled():
            # a frozen weight delivers no gradient, so no round closing tells when the block's backward
            # no longer needs it (a frozen norm's backward runs after every adapter's): the gradient of
            # the block's input, computed last, does
            for t in _tensors(list(args) + list((kwargs or {}).values())):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._after_backward(u, grad))
        nxt = blocks[0] if u.root and (blocks := self._blocks.get(u.stage)) else self._neighbour(u, 1)
        if nxt is not None and nxt is not u:
            self.gather_unit(nxt, wait=False)

    def _after_forward(self, u: Unit, output: Any) -> None:
        if not torch.is_grad_enabled():
            self.release_unit(u)
            return
        if u.root:
            return
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(lambda grad, u=u: self._before_backward(u, grad))
        if self.reshard_after_forward:
            self.release_unit(u)

    def _before_backward(self, u: Unit, grad: torch.Tensor) -> torch.Tensor:
        self.gather_unit(u)
        prev = self._neighbour(u, -1)
        if prev is not None:
            self.gather_unit(prev, wait=False)
        return grad

    def _after_backward(self, u: Unit, grad: torch.Tensor) -> torch.Tensor:
        """The block's input gradient is computed: its backward is over, its frozen weights are freed."""
        for b in self._frozen_of.get(u.index, []):
            self.release(b)
        return grad

    def after_round(self, b: Bucket, complete: bool) -> None:
        """:class:`~plait.data_parallel.sharded_grads.ShardedGradSync`'s callback: a block's bucket
        whose backward is over is freed (a root stays gathered until the update)."""
        if complete and not self.units[b.unit].root:
            self.release(b)


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors a module returned (a tensor, or the tensors of a tuple or list)."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if torch.is_tensor(t)]
    return []
