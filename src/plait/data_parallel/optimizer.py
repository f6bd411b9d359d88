"""The optimizer of a rank: flat buffers, optional ZeRO-1 sharding, precision, exact norm, clipping.

One object covers every combination of data parallelism, ZeRO-1 and precision preset:

* the model's weights become views of one flat buffer in ``policy.param_dtype`` (same layout as
  the gradient buffer of :class:`~plait.data_parallel.grad_sync.GradSync`);
* the optimizer updates *segments*: 1-D views of the ranges this rank owns (everything without
  ZeRO-1; one ``1/dp`` shard of every bucket with it). A segment views the weights themselves
  (the owned range of the parameter buffer) when they are in the optimizer's dtype, with or
  without ZeRO-1; only ``bf16-mixed`` has a flat fp32 master buffer (of the owned ranges);
* after the update, master values are written back to the weights (cast) and, with ZeRO-1,
  all-gathered over the data-parallel group so every replica holds the whole updated model.

The inner optimizer is a stock ``torch.optim.AdamW`` (fused where available) over fp32 segments,
or :class:`~plait.optim.lowp_adamw.LowPrecisionAdamW` when it updates bf16 weights directly, so a
learning-rate scheduler drives ``inner`` as usual. Optimizer state therefore exists only for the
owned segments: its bytes per rank are ``1/dp`` of the unsharded total plus the padding that
makes buckets divide evenly (:meth:`DistributedOptimizer.memory_report`).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.primitives import GroupInfo, all_gather_single
from plait.data_parallel.buckets import Bucket, BucketPlan, ParamEntry, Segment, plan_buckets
from plait.data_parallel.collectives import Handle, ShardCollectives
from plait.data_parallel.grad_sync import GradSync
from plait.data_parallel.param_shards import ShardedParams, plan_units
from plait.data_parallel.sharded_grads import ShardedGradSync
from plait.optim.flat_adamw import FlatAdamW, FlatRun
from plait.optim.lowp_adamw import LowPrecisionAdamW
from plait.parallel_state import norm_share, shard_specs, shared_across_stages
from plait.precision import PrecisionPolicy


class PlaceholderValues(Protocol):
    """Where the values of a model built with placeholders come from (``plait.deferred.DeferredValues``):
    the optimizer writes the ranges it keeps, inside a ``with`` block that keeps the sources open."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...

    def write_flat_(self, param: torch.Tensor, start: int, dest: torch.Tensor) -> None:
        """Write elements ``[start, start + len(dest))`` of ``param``'s flattened value into ``dest``."""

    def left_in(self, modules: list[nn.Module]) -> list[str]:
        """The parameters of ``modules`` still holding placeholders."""


@dataclass
class OptimizerHyper:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    seed: int = 0


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights, biases and other 1-D parameters are not decayed."""
    return param.dim() < 2 or name.endswith(".bias") or "norm" in name


def _tied_names(modules: list[nn.Module], pp: GroupInfo | None) -> frozenset[str]:
    """Parameters shared between pipeline stages (the tied embedding), whose gradients are summed
    over the tied group before the norm."""
    if pp is None or pp.size == 1:
        return frozenset()
    return frozenset().union(*(shared_across_stages(m) for m in modules))


def _frozen_params(modules: list[nn.Module], trained: set[int]) -> list[tuple[str, nn.Parameter, bool, float]]:
    """ZeRO-3: the parameters nobody trains (LoRA's frozen base), to be sharded and gathered like the
    rest; none when they differ in dtype (then they stay whole, as before)."""
    out, seen = [], set(trained)
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p, False, 0.0))
    if len({p.dtype for _, p, _, _ in out}) > 1:
        warnings.warn("ZeRO-3: the frozen parameters are of several dtypes; they stay whole on every rank",
                      stacklevel=3)
        return []
    return out


def _continues(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether 1-D view ``b`` starts where ``a`` ends, in the same storage."""
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.dtype == b.dtype
            and a.storage_offset() + a.numel() == b.storage_offset())


def _joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The 1-D view covering ``a`` then ``b`` (which continues it, see :func:`_continues`)."""
    return a.as_strided((a.numel() + b.numel(),), (1,), a.storage_offset())


class DistributedOptimizer:
    """AdamW over this rank's share of the model (see the module doc)."""

    def __init__(self, modules: list[nn.Module], policy: PrecisionPolicy, hyper: OptimizerHyper, *,
                 dp: GroupInfo, tp: GroupInfo, pp: GroupInfo | None = None, tied: GroupInfo | None = None,
                 zero: bool | int = False, bucket_mb: float = 25.0, overlap: bool = True,
                 ep: GroupInfo | None = None, expert_dp: GroupInfo | None = None,
                 expert_names: frozenset[str] = frozenset(), collectives: ShardCollectives | None = None,
                 prefetch_params: bool = False, reshard_after_forward: bool = True,
                 values: PlaceholderValues | None = None, offload: bool = False,
                 hybrid: tuple[GroupInfo, GroupInfo] | None = None) -> None:
        """``zero``: the ZeRO level, 0-3 (``True`` is level 1); see docs/data_parallel.md.
        ``values``: the model was built with placeholders (:func:`plait.materialize.build_stages_deferred`);
        the optimizer fills the weights it keeps from them (under ZeRO-3 its owned chunks only).
        ``offload``: the fp32 master weights and AdamW moments live in host memory and are updated
        there (see :meth:`step`); the device keeps the weights and the gradients only.
        ``hybrid``: (the data-parallel ranks of this host, the ranks holding the same shards on the
        other hosts): ZeRO shards over the first and replicates over the second (hybrid sharding;
        ignored at level 0, where nothing is sharded)."""
        # expert parallelism: ``expert_names`` differ between the ``ep`` ranks and are reduced over
        # ``expert_dp`` (see GradSync); at ep=1 they are ordinary parameters
        if ep is None or ep.size == 1:
            ep, expert_dp, expert_names = None, None, frozenset()
        self.ep = ep
        level = int(zero)
        if level not in (0, 1, 2, 3):
            raise ValueError(f"zero={zero!r}: the ZeRO level is 0, 1, 2 or 3")
        if level and dp.size == 1:
            warnings.warn(f"ZeRO-{level} with a data-parallel degree of 1 shards nothing; training unsharded",
                          stacklevel=2)
            level = 0
        #: the ZeRO level: 1 shards optimizer state, 2 also gradients, 3 also the weights
        self.level = level
        self.policy, self.dp, self.tp, self.pp, self.zero = policy, dp, tp, pp, level >= 1
        if hybrid is not None and ep is not None:
            raise ValueError("hybrid sharding does not work with expert parallelism yet")
        shard_group, replicas = hybrid if hybrid is not None and self.zero else (dp, None)
        #: the ranks that split the sharded states (the host's data-parallel ranks under hybrid sharding)
        self.shard_group = shard_group
        if offload and policy.master_dtype != torch.float32:
            raise ValueError(f"offload keeps an fp32 master copy in host memory; this precision policy's master is "
                             f"{policy.master_dtype} (bf16-pure): use bf16-mixed or fp32")
        #: master weights and moments in host memory, updated there
        self.offload = offload
        self.shards = shard_group.size if self.zero else 1
        params, seen = [], set()
        for module in modules:
            specs = shard_specs(module)
            for name, p in module.named_parameters():
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                share = norm_share(module, name, specs.get(name), tp.rank)
                params.append((name, p, not no_weight_decay(name, p), share))
        if not params:
            raise ValueError("the model has no trainable parameters")
        device = params[0][1].device
        deferred = _tied_names(modules, pp)
        bucket_numel = max(1, int(bucket_mb * 2**20 / torch.empty((), dtype=policy.grad_dtype).element_size()))
        units, unit_of = plan_units(modules) if level == 3 else ([], None)
        self.bucket_plan: BucketPlan = plan_buckets(params, bucket_numel=bucket_numel, dp=shard_group,
                                                     sharded=self.zero, replicas=replicas,
                                                     deferred_names=deferred, expert_names=expert_names,
                                                     expert_dp=expert_dp, unit_of=unit_of)
        self.segments: list[Segment] = self.bucket_plan.owned_segments()
        self.device = device
        #: where the optimizer's own tensors (master weights, moments, the gradients they read) live; a
        #: dry run builds on the meta device, and its host side stays on meta too: nothing is allocated
        self.state_device = torch.device("cpu") if offload and device.type != "meta" else device
        #: host tensors are page-locked so the copies to and from a GPU run asynchronously
        self._pinned = offload and device.type == "cuda"
        self.grads: GradSync | ShardedGradSync
        if level >= 2:
            self.grads = ShardedGradSync(self.bucket_plan, grad_dtype=policy.grad_dtype, device=device, dp=dp,
                                         overlap=overlap, tied=tied if deferred else None, collectives=collectives)
        else:
            self.grads = GradSync(self.bucket_plan, grad_dtype=policy.grad_dtype, device=device, dp=dp,
                                  zero=self.zero, overlap=overlap, tied=tied if deferred else None,
                                  collectives=collectives)
        #: ZeRO-3: the owned chunks of the weights and the units that gather them
        self.params: ShardedParams | None = None
        if level == 3:
            frozen = _frozen_params(modules, seen)
            frozen_plan = plan_buckets(frozen, bucket_numel=bucket_numel, dp=shard_group, sharded=True,
                                       unit_of=unit_of) if frozen else None
            self.params = ShardedParams(self.bucket_plan, units, dtype=policy.param_dtype, device=device,
                                        collectives_of=self.grads.collectives_of,
                                        reshard_after_forward=reshard_after_forward, frozen_plan=frozen_plan)
            assert isinstance(self.grads, ShardedGradSync)
            self.grads.on_round_closed = self.params.after_round
        self._build_weights(device, values, modules)
        if self.params is not None:
            self.params.register_hooks()
        self.inner = self._build_inner(hyper)
        #: the clipping factor's reciprocal that the next step's kernel divides the gradients by
        self._grad_scale: torch.Tensor | None = None
        #: ZeRO-1 gathers still in flight, per bucket index (only with ``prefetch_params``)
        self._pending: dict[int, list[Handle]] = {}
        #: leave ZeRO-1's parameter gathers in flight after :meth:`step`, awaited by each module's
        #: forward (overlapping them with the next forward); then every read of the weights outside
        #: a forward must call :meth:`wait_params` first
        self.prefetch_params = prefetch_params and level in (1, 2)
        if self.prefetch_params:
            self._register_prefetch_hooks(modules)

    # ------------------------------------------------------------------ construction
    @torch.no_grad()
    def _build_weights(self, device: torch.device, values: PlaceholderValues | None, modules: list[nn.Module]) -> None:
        """Move the weights into the flat parameter buffer and, where needed, the master buffer
        (from the built weights, or from ``values`` when the model holds placeholders)."""
        pol, plan = self.policy, self.bucket_plan

        def fill(e: ParamEntry, a: int, z: int, dest: torch.Tensor) -> None:
            """Write flat elements ``[a, z)`` (buffer offsets) of entry ``e``'s initial value into ``dest``."""
            if values is not None:
                values.write_flat_(e.param, a - e.start, dest)
            else:
                dest.copy_(e.param.detach().reshape(-1)[a - e.start:z - e.start])

        with values if values is not None else contextlib.nullcontext():
            if self.params is None:
                self.param_data = torch.zeros(plan.numel, dtype=pol.param_dtype, device=device)
                for e in plan.entries:
                    fill(e, e.start, e.end, self.param_data[e.start:e.end])
            self.has_master = pol.separate_master or self.offload
            self.master_views: list[torch.Tensor] = []  # per bucket: the owned range in master dtype
            #: offload: per bucket, the host copy of the owned reduced gradient that AdamW reads
            self.host_grad_views: list[torch.Tensor] = []
            if self.offload:
                self.host_grad_data, self.host_grad_views = self._owned_flat(pol.master_dtype)
            if self.has_master:
                self.master_data, self.master_views = self._owned_flat(pol.master_dtype)
                for s in self.segments:
                    lo, _ = s.bucket.owned_range
                    fill(s.entry, s.start, s.end, self.master_views[s.bucket.index][s.start - lo:s.end - lo])
            if self.params is not None:  # ZeRO-3: the owned chunks are taken, the whole weights freed
                def from_master(e: ParamEntry, a: int, z: int, dest: torch.Tensor) -> None:
                    lo = plan.buckets[e.bucket].owned_range[0]
                    dest.copy_(self.master_views[e.bucket][a - lo:z - lo])

                # from the master just filled, if any: each range is computed or read once
                self.params.adopt(from_master if self.has_master else fill)
        if self.params is None:
            for e in plan.entries:  # only now: the originals were read above
                e.param.data = self.param_data[e.start:e.end].view(e.param.shape)
        if values is not None and (left := values.left_in(modules)):
            raise ValueError(f"the model was built with placeholders, but {len(left)} of its parameters are not "
                             f"trained here and kept them (e.g. {left[0]!r}): build frozen parameters normally "
                             f"(plait.materialize.build_stages), as LoRA's frozen base is")

    def _owned_flat(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A zeroed flat tensor of every bucket's owned range on the optimizer's device (page-locked
        host memory when offloading to a GPU's host), and its view per bucket."""
        sizes = [b.numel // b.shards for b in self.bucket_plan.buckets]
        flat = torch.zeros(sum(sizes), dtype=dtype, device=self.state_device, pin_memory=self._pinned)
        return flat, list(flat.split(sizes)) if sizes else []

    def _update_grads(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s owned reduced gradient as AdamW reads it (its host copy when offloading)."""
        if self.offload:
            return self.host_grad_views[b.index]
        lo, hi = b.owned_range
        return self.grads.reduced_view(lo, hi)

    def _owned_weights(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s owned range of the weights themselves (in their dtype)."""
        if self.params is not None:
            return self.params.owned_values(b)
        lo, hi = b.owned_range
        return self.param_data[lo:hi]

    def _segment_tensors(self, s: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """(the values the optimizer updates, the reduced gradient it reads) of one segment."""
        lo, _ = s.bucket.owned_range
        grad = self._update_grads(s.bucket)[s.start - lo:s.end - lo]
        if not self.has_master:
            return self._owned_weights(s.bucket)[s.start - lo:s.end - lo], grad
        return self.master_views[s.bucket.index][s.start - lo:s.end - lo], grad

    def _build_inner(self, hyper: OptimizerHyper) -> torch.optim.Optimizer:
        decay: list[torch.Tensor] = []
        keep: list[torch.Tensor] = []
        self.main_params, self.main_grads, self.main_weights = [], [], []
        for s in self.segments:
            value, grad = self._segment_tensors(s)
            value.grad = grad
            (decay if s.entry.decay else keep).append(value)
            self.main_params.append(value)
            self.main_grads.append(self.grads.reduced_view(s.start, s.end))  # on the device: norm, clipping
            self.main_weights.append(s.entry.norm_weight)
        groups = [{"params": decay, "weight_decay": hyper.weight_decay}, {"params": keep, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]] or [{"params": [torch.zeros(0, device=self.state_device)],
                                                         "weight_decay": 0.0}]
        if self.policy.master_dtype == torch.bfloat16:
            return LowPrecisionAdamW(groups, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps,
                                     stochastic_rounding=self.policy.stochastic_rounding, seed=hyper.seed)
        if hasattr(torch, "_fused_adamw_") and self.segments:
            return FlatAdamW(groups, self._flat_runs(), lr=hyper.lr, betas=hyper.betas, eps=hyper.eps)
        if "fused" in inspect.signature(torch.optim.AdamW).parameters:
            return torch.optim.AdamW(groups, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, fused=True)
        return torch.optim.AdamW(groups, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps)

    def _flat_runs(self) -> list[FlatRun]:
        """The owned range of every bucket as (values, reduced gradients); without ZeRO-1 adjacent
        ranges are merged where values and gradients both continue in memory (the whole buffer)."""
        runs: list[FlatRun] = []
        self._run_buckets: list[list[Bucket]] = []
        for b in self.bucket_plan.buckets:
            lo, hi = b.owned_range
            values = self.master_views[b.index] if self.has_master else self._owned_weights(b)
            grads = self._update_grads(b)
            members = [self.main_params[i] for i, s in enumerate(self.segments) if s.bucket is b]
            last = runs[-1] if runs and not self.zero else None  # ZeRO-1: one run per bucket, published in turn
            if last is not None and _continues(last.values, values) and _continues(last.grads, grads):
                runs[-1] = FlatRun(_joined(last.values, values), _joined(last.grads, grads), last.members + members)
                self._run_buckets[-1].append(b)
            else:
                runs.append(FlatRun(values, grads, members))
                self._run_buckets.append([b])
        return runs

    # ------------------------------------------------------------------ the step
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the reduced gradients, equal to the single-process one (device tensor).

        Each rank sums the squares of the segments it owns, weighted so that every gradient
        entry counts once (see :func:`plait.parallel_state.norm_share`); the partial sums are added over TP, PP
        and, with ZeRO-1, the data-parallel shards. Under expert parallelism the experts' squares are
        first added over the expert group, whose ranks hold different experts.
        """
        device = self.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        experts = torch.zeros((), dtype=torch.float32, device=device)
        counted = [(g, w, s.bucket.expert) for g, w, s in zip(self.main_grads, self.main_weights, self.segments,
                                                              strict=True) if w > 0 and g.numel()]
        if counted:
            norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g, _, _ in counted], 2)
            weights = torch.tensor([w for _, w, _ in counted], dtype=torch.float32, device=device)
            is_expert = torch.tensor([float(e) for _, _, e in counted], dtype=torch.float32, device=device)
            squares = torch.stack(norms).pow(2) * weights
            total = (squares * (1 - is_expert)).sum()  # multiplying by masks: no data-dependent shape
            experts = (squares * is_expert).sum()
        if self.ep is not None and not self.zero:  # under ZeRO-1 the dp sum below covers the expert group
            dist.all_reduce(experts, group=self.ep.group)
        total = total + experts
        for group in (self.tp, self.pp, self.shard_group if self.zero else None):
            if group is not None and group.size > 1:
                dist.all_reduce(total, group=group.group)
        return total.sqrt()

    def clip_(self, norm: torch.Tensor, max_norm: float) -> None:
        """Scale the gradients by ``min(1, max_norm / norm)`` without reading ``norm`` on the host.

        With the flat fused AdamW the scaling is folded into the next :meth:`step`: the kernel
        divides each gradient by ``1 / coef`` as it reads it (no separate pass over the gradients;
        exact when nothing is clipped, within an ulp of ``grad * coef`` otherwise), so the gradients
        themselves are left unscaled until then.
        """
        grads = [g for g in self.main_grads if g.numel()]
        if max_norm <= 0 or not grads:
            return
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if isinstance(self.inner, FlatAdamW):
            self._grad_scale = coef.to(torch.float32).reciprocal().reshape(())
            return
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """Update the owned segments, publish the new weights to the model, clear the gradients.

        ``found_inf`` (a device scalar, 1.0 = skip): the fused AdamW skips the whole update on the
        device, without a host read, and leaves its step counters as they were; the low-precision
        AdamW reads the flag on the host (one read per step, only when skipping is enabled).

        Publishing overlaps the update: with the flat fused AdamW each bucket's owned range is
        updated in turn, in the order the next forward needs the weights (last bucket first: the
        buffer is in reverse registration order), and its gather starts at once while the next
        range updates. The gathers are awaited here, or with ``prefetch_params`` by the forward
        pre-hook of each module that holds the bucket's parameters (see :meth:`wait_params`).
        """
        self.wait_params()  # a gather still in flight reads the owned ranges this step rewrites
        if self.params is not None:  # ZeRO-3: gathered weights would go stale; the next forward gathers
            self.params.release_all()
        if self.offload:
            found_inf = self._gradients_to_host(found_inf)
        publish = self.has_master or self.zero
        pending: dict[int, list[Handle]] = {}

        def after_run(i: int) -> None:
            for b in self._run_buckets[i]:
                pending[b.index] = self._publish(b)

        if isinstance(self.inner, FlatAdamW):
            # read off the optimizer, as torch's fused AdamW does (GradScaler protocol)
            self.inner.found_inf = None if found_inf is None else found_inf.to(torch.float32).reshape(())  # type: ignore[attr-defined]
            self.inner.grad_scale, self._grad_scale = self._grad_scale, None  # type: ignore[attr-defined]
            try:
                order = list(reversed(range(len(self._run_buckets))))
                self.inner.step_runs(after_run if publish else None, order=order)
            finally:
                self.inner.found_inf = self.inner.grad_scale = None  # type: ignore[attr-defined]
        else:
            if found_inf is not None and getattr(self.inner, "defaults", {}).get("fused"):
                self.inner.found_inf = found_inf.to(torch.float32).reshape(())  # type: ignore[attr-defined]
                try:
                    self.inner.step()
                finally:
                    del self.inner.found_inf  # type: ignore[attr-defined]
            elif found_inf is not None and bool(found_inf.item()):
                pass  # skip: weights, moments and step counts stay as they were
            else:
                self.inner.step()
            if publish:
                for b in reversed(self.bucket_plan.buckets):
                    pending[b.index] = self._publish(b)
        self._pending = {i: works for i, works in pending.items() if works}
        if not self.prefetch_params:
            self.wait_params()
        self.grads.zero_()

    def _gradients_to_host(self, found_inf: torch.Tensor | None) -> torch.Tensor | None:
        """Offload: copy the owned reduced gradients (and the step's skip flag and clipping factor)
        to host memory for the host update, in the order the update reads them. From a GPU the copies
        are asynchronous into page-locked memory and awaited once, before the update starts; the
        updated values go back the same way, bucket by bucket, while the next bucket updates."""
        for b in reversed(self.bucket_plan.buckets):
            lo, hi = b.owned_range
            self.host_grad_views[b.index].copy_(self.grads.reduced_view(lo, hi), non_blocking=self._pinned)
        if self._grad_scale is not None:
            self._grad_scale = self._grad_scale.to(self.state_device, non_blocking=self._pinned)
        if found_inf is not None:
            found_inf = found_inf.to(self.state_device, non_blocking=self._pinned)
        if self._pinned:
            torch.cuda.current_stream(self.device).synchronize()
        return found_inf

    def _publish(self, b: Bucket) -> list[Handle]:
        """Write bucket ``b``'s updated owned range into the weights and start sharing it (ZeRO-1);
        returns the work handles."""
        master = self.master_views[b.index] if self.has_master else None
        if self.params is not None:  # ZeRO-3: the owned chunk is all a rank keeps
            if master is not None:
                self.params.owned_values(b).copy_(master, non_blocking=self._pinned)
            return []
        if b.shards > 1:  # ZeRO-1: the owned shard is in place; the backend's collectives fill the rest
            if master is not None:
                lo, hi = b.owned_range
                self.param_data[lo:hi].copy_(master, non_blocking=self._pinned)
            return self.grads.collectives_of(b).gather(self.param_data[b.start:b.end], b.group)
        # without ZeRO-1, or one replica per expert (the whole bucket is owned): only a master to copy
        assert master is not None or self.zero, "without ZeRO-1 the weights are published only from a master copy"
        if master is not None:
            self.param_data[b.start:b.end].copy_(master, non_blocking=self._pinned)
        return []

    @contextlib.contextmanager
    def weights_gathered(self, *, write_back: bool = False) -> Iterator[None]:
        """The model's weights readable (and writable) outside a forward for the duration: under
        ZeRO-3 every unit is gathered, and with ``write_back`` the owned chunks are taken from the
        weights afterwards (after loading a checkpoint into them); otherwise only pending gathers
        are awaited. Collective under ZeRO-3: every data-parallel rank must enter it."""
        self.wait_params()
        if self.params is None:
            yield
            return
        with self.params.gathered(write_back=write_back):
            yield

    def local_shape(self, param: torch.Tensor) -> torch.Size:
        """``param``'s local (TP-shard) shape, also while ZeRO-3 has freed it."""
        return self.params.local_shape(param) if self.params is not None else param.shape

    def weights_in_turn(self, *, write_back: bool = False) -> Iterator[list[ParamEntry]]:
        """The trained parameters in groups whose weights are readable (and writable) while the group
        is current: under ZeRO-3 one bucket at a time, gathered (with ``write_back`` the owned chunk
        is taken from it afterwards), so loading a checkpoint holds one bucket beyond the chunks;
        otherwise every parameter at once. Collective under ZeRO-3: every data-parallel rank must
        run the whole iteration."""
        self.wait_params()
        if self.params is None:
            yield list(self.bucket_plan.entries)
            return
        for b in self.bucket_plan.buckets:
            with self.params.bucket_gathered(b, write_back=write_back):
                yield list(b.entries)

    def wait_params(self) -> None:
        """Wait for every parameter gather still in flight (``prefetch_params``): call before reading
        the weights outside a forward (the optimizer's own methods and ``state_dict()`` do)."""
        pending, self._pending = self._pending, {}
        for works in pending.values():
            for work in works:
                work.wait()

    def _await_buckets(self, buckets: tuple[int, ...]) -> None:
        """Forward pre-hook body: wait for the gathers of ``buckets`` (the module's own parameters)."""
        if not self._pending:
            return
        for i in buckets:
            for work in self._pending.pop(i, ()):
                work.wait()

    def _register_prefetch_hooks(self, modules: list[nn.Module]) -> None:
        """Hooks that make a deferred gather land before its weights are read: a forward pre-hook on
        every module that holds parameters itself (tied weights are held by both modules), and a
        ``state_dict`` pre-hook on the top modules."""
        bucket_of = {id(e.param): e.bucket for e in self.bucket_plan.entries}
        self._hooks = []
        for module in modules:
            for sub in module.modules():
                buckets = tuple(sorted({bucket_of[id(p)] for p in sub.parameters(recurse=False)
                                        if id(p) in bucket_of}))
                if buckets:
                    self._hooks.append(sub.register_forward_pre_hook(
                        lambda _m, _a, buckets=buckets: self._await_buckets(buckets)))
            self._hooks.append(module.register_state_dict_pre_hook(lambda *_: self.wait_params()))

    # ------------------------------------------------------------------ reporting
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: optimizer state, master weights, the persistent weight
        and gradient buffers (ZeRO-3's and ZeRO-2's owned chunks; transient gathers not counted),
        and buffer padding. ``frozen_bytes``: ZeRO-3's owned chunks of the frozen parameters (LoRA's
        base). ``host_bytes``: what of it lives in host memory (offload: the master,
        the moments and the host copy of the owned gradients), not on the device."""
        owned = sum(s.numel for s in self.segments)
        item = torch.empty((), dtype=self.policy.master_dtype).element_size()
        state = sum(t.numel() * t.element_size() for st in self.inner.state.values() for t in st.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        weights = self.params.shard_data if self.params is not None else self.param_data
        grads = self.grads.shard_data if isinstance(self.grads, ShardedGradSync) else self.grads.data
        master = self.master_data.numel() * self.master_data.element_size() if self.has_master else 0
        host = 0
        if self.offload:
            host = state + master + self.host_grad_data.numel() * self.host_grad_data.element_size()
        frozen = self.params.frozen_data if self.params is not None else None
        return {"owned_elements": owned, "optimizer_state_bytes": state, "host_bytes": host,
                "frozen_bytes": frozen.numel() * frozen.element_size() if frozen is not None else 0,
                "weight_bytes": weights.numel() * weights.element_size(),
                "grad_bytes": grads.numel() * grads.element_size(),
                "expected_state_bytes": 2 * owned * item,
                "master_bytes": master, "padding_elements": self.bucket_plan.padding,
                "total_elements": self.bucket_plan.numel}

    # ------------------------------------------------------------------ checkpoints
    def state_kinds(self) -> list[str]:
        """The per-parameter optimizer tensors a checkpoint holds (master only when it differs from the weights)."""
        return ["exp_avg", "exp_avg_sq"] + (["master"] if self.policy.separate_master else [])

    def step_count(self) -> int:
        """Optimizer steps taken (read on the host; for checkpoints, not for the training loop)."""
        for st in self.inner.state.values():
            step = st.get("step")
            if step is not None:
                return int(step.item()) if torch.is_tensor(step) else int(step)
        return 0

    @torch.no_grad()
    def param_states(self) -> Iterator[tuple[ParamEntry, dict[str, torch.Tensor]]]:
        """Yield ``(entry, {kind: tensor})`` for every parameter, each tensor in the local parameter's shape.

        Under ZeRO-1 each bucket's owned ranges are all-gathered over the data-parallel group, so
        every DP rank must run the whole iteration (collective); memory grows by one bucket at a time.
        """
        self.wait_params()
        kinds = self.state_kinds()
        if not self.zero:  # every segment is a whole parameter: hand out views, no copy
            for i, s in enumerate(self.segments):
                e, main = s.entry, self.main_params[i]
                state = self.inner.state.get(main, {})
                out = {}
                for kind in kinds:
                    src = main if kind == "master" else state.get(kind)
                    out[kind] = (src if src is not None else torch.zeros_like(main)).view(e.param.shape)
                yield e, out
            return
        by_bucket: dict[int, list[int]] = {}
        for i, s in enumerate(self.segments):
            by_bucket.setdefault(s.bucket.index, []).append(i)
        device = self.device
        for b in self.bucket_plan.buckets:
            lo, hi = b.owned_range
            flats = {}
            for kind in kinds:
                owned = torch.zeros(hi - lo, dtype=self.policy.master_dtype, device=device)
                for i in by_bucket.get(b.index, []):
                    s = self.segments[i]
                    main = self.main_params[i]
                    src = main if kind == "master" else self.inner.state.get(main, {}).get(kind)
                    if src is not None:
                        owned[s.start - lo:s.end - lo].copy_(src.reshape(-1))
                if b.shards > 1:
                    full = torch.empty(b.numel, dtype=owned.dtype, device=device)
                    all_gather_single(full, owned, group=b.group.group)
                    owned = full
                flats[kind] = owned
            with self.params.bucket_gathered(b) if self.params is not None else contextlib.nullcontext():
                for e in b.entries:  # ZeRO-3: ``e.param`` holds the gathered weights meanwhile
                    yield e, {k: v[e.start - b.start:e.end - b.start].view(e.param.shape) for k, v in flats.items()}

    @torch.no_grad()
    def load_param_state(self, name: str, state: dict[str, torch.Tensor], step: int) -> None:
        """Set one parameter's optimizer state from local-shape tensors (``exp_avg``, ``exp_avg_sq``,
        optionally ``master``). The model weights must already hold the loaded values: without a
        ``master`` tensor the master copy is taken from them."""
        self.wait_params()
        for i in self._segments_of(name):
            s, main = self.segments[i], self.main_params[i]
            a, z = s.start - s.entry.start, s.end - s.entry.start
            if self.has_master:
                src = state.get("master")
                main.copy_((src if src is not None else s.entry.param).reshape(-1)[a:z])
            new: dict = {k: state[k].reshape(-1)[a:z].to(main.device, main.dtype).clone()
                         for k in ("exp_avg", "exp_avg_sq")}
            if isinstance(self.inner, FlatAdamW):  # the state is a view of the flat moments: copy into it
                self.inner.set_state(main, new["exp_avg"], new["exp_avg_sq"], step)
                continue
            lowp = self.policy.master_dtype == torch.bfloat16
            new["step"] = step if lowp else torch.tensor(float(step), dtype=torch.float32, device=main.device)
            self.inner.state[main] = new

    def _segments_of(self, name: str) -> list[int]:
        if not hasattr(self, "_by_name"):
            self._by_name: dict[str, list[int]] = {}
            for i, s in enumerate(self.segments):
                self._by_name.setdefault(s.entry.name, []).append(i)
        return self._by_name.get(name, [])

    @torch.no_grad()
    def sync_master_from_weights(self, names: set[str] | None = None) -> None:
        """Copy the model weights (of the parameters ``names``, default all) into the master copy,
        after loading weights without optimizer state; their weights must be readable."""
        self.wait_params()
        if not self.has_master:
            return
        for i, s in enumerate(self.segments):
            if names is not None and s.entry.name not in names:
                continue
            a, z = s.start - s.entry.start, s.end - s.entry.start
            self.main_params[i].copy_(s.entry.param.reshape(-1)[a:z])
