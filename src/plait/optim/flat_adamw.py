"""AdamW over slices of flat buffers, stepped by one fused kernel call over the whole buffers.

Why: the data-parallel optimizer updates 1-D *segments* (one per parameter, or per part of a
parameter inside an owned ZeRO-1 shard) that are views of a few flat buffers: the weights (or
their fp32 master copy) and the reduced gradients. ``torch.optim.AdamW(fused=True)`` over the
segments is exact but pays per tensor: the optimizer's Python grouping, a step counter per
segment, and on the CPU one kernel call and one thread-pool dispatch per segment, which for a
model of a few hundred small tensors is a noticeable share of the step. Here the moments are
flat buffers too, each segment's state is a view into them, and a step calls
``torch._fused_adamw_`` once over the flat *runs* (the longest stretches that are contiguous in
values, gradients and moments alike: the whole buffer without ZeRO-1, one per bucket shard with
it). Padding between parameters is updated too and stays zero (zero gradient, zero moments, zero
weight).

Semantics are those of ``torch.optim.AdamW(fused=True)`` on the segments, including the
per-group weight decay (norms and biases are in a group without decay): decay is applied before
the fused call by multiplying each decayed group by ``1 - lr * weight_decay`` (the factor rounded
to the weights' dtype), then the fused kernel runs with no decay. On the CPU the fused kernel
decays the same way (``p * (1 - lr * wd)`` with the factor in fp32) before its update, so the
result is bitwise equal; the CUDA kernel computes ``p - lr * wd * p`` instead, which can differ in
the last bit of the decayed weight. When the groups differ in ``lr``, ``betas`` or ``eps`` (a
scheduler that treats groups differently) the step falls back to one fused call per group over
its segments, which is exactly the stock optimizer.

``found_inf`` (a device scalar, 1.0 = skip the step) is honoured without a host read: the kernel
leaves everything unchanged, the decay factor becomes 1, and the step counters are restored, as
in ``torch.optim.AdamW(fused=True)``. ``grad_scale`` (a device scalar, also set as an attribute)
divides the gradients inside the kernel before the update, which lets the caller fold gradient
clipping into the step instead of a separate pass over the gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class FlatRun:
    """One contiguous stretch: ``values`` and ``grads`` are equal-length 1-D views; ``members`` are
    the segments (views of ``values``) it holds."""

    values: torch.Tensor
    grads: torch.Tensor
    members: list[torch.Tensor] = field(default_factory=list)


class FlatAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW(fused=True)`` over ``param_groups`` of segment views, whose values and
    ``.grad`` lie in ``runs`` (every segment in exactly one run). See the module doc."""

    def __init__(self, param_groups: list[dict], runs: list[FlatRun], *, lr: float, betas: tuple[float, float],
                 eps: float) -> None:
        super().__init__(param_groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "fused": True})
        self.runs = runs
        # one step counter per run, shared by the state of its segments (the stock optimizer keeps
        # one per tensor; every segment takes the same steps, so they would always be equal)
        self.run_steps = [torch.zeros((), dtype=torch.float32, device=r.values.device) for r in runs]
        self.run_moments = [(torch.zeros_like(r.values), torch.zeros_like(r.values)) for r in runs]
        in_group = {id(p) for g in self.param_groups for p in g["params"]}
        for run, step, (exp_avg, exp_avg_sq) in zip(runs, self.run_steps, self.run_moments, strict=True):
            if run.values.shape != run.grads.shape or run.values.dim() != 1:
                raise ValueError(f"FlatAdamW: a run's values {tuple(run.values.shape)} and gradients "
                                 f"{tuple(run.grads.shape)} must be 1-D views of equal length")
            base = run.values.storage_offset()
            for p in run.members:
                if id(p) not in in_group:
                    raise ValueError("FlatAdamW: every member of a run must be in a parameter group")
                a = p.storage_offset() - base
                if p.untyped_storage().data_ptr() != run.values.untyped_storage().data_ptr() or \
                        not 0 <= a <= a + p.numel() <= run.values.numel():
                    raise ValueError("FlatAdamW: a run member is not a slice of the run's values")
                self.state[p] = {"step": step, "exp_avg": exp_avg[a:a + p.numel()].view(p.shape),
                                 "exp_avg_sq": exp_avg_sq[a:a + p.numel()].view(p.shape)}

    @torch.no_grad()
    def set_state(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int) -> None:
        """Load one segment's moments (copied into the flat buffers) and the step count (of its run)."""
        state = self.state[p]
        state["exp_avg"].copy_(exp_avg.reshape(state["exp_avg"].shape))
        state["exp_avg_sq"].copy_(exp_avg_sq.reshape(state["exp_avg_sq"].shape))
        state["step"].fill_(float(step))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_runs()
        return loss

    @torch.no_grad()
    def step_runs(self, after_run: Callable[[int], None] | None = None, order: list[int] | None = None) -> None:
        """One step, run by run in ``order`` (default: as given), calling ``after_run(i)`` as soon as
        run ``i`` is updated, so a caller can start communicating it while later runs update."""
        # an LR scheduler learns that the optimizer stepped from this flag, which torch's own step
        # wrapper sets; step_runs bypasses that wrapper, so without it every scheduler.step() warns
        self._opt_called = True
        found_inf = getattr(self, "found_inf", None)  # the GradScaler protocol of the fused optimizers
        grad_scale = getattr(self, "grad_scale", None)  # the kernel divides the gradients by it first
        if not self.runs:
            return
        order = list(range(len(self.runs))) if order is None else order
        torch._foreach_add_(self.run_steps, 1)
        groups = self.param_groups
        same = {(g["lr"], tuple(g["betas"]), g["eps"]) for g in groups}
        if len(same) == 1:
            lr, (beta1, beta2), eps = groups[0]["lr"], groups[0]["betas"], groups[0]["eps"]
            for g in groups:
                if g["weight_decay"] != 0 and g["params"]:
                    factor = 1 - lr * g["weight_decay"]
                    if found_inf is None:
                        torch._foreach_mul_(g["params"], factor)
                    else:  # the factor in the weights' dtype, or exactly 1 when the step is skipped
                        keep = torch.full((), factor, dtype=g["params"][0].dtype, device=found_inf.device)
                        torch._foreach_mul_(g["params"], torch.where(found_inf > 0, torch.ones_like(keep), keep))
            kw = dict(amsgrad=False, lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, maximize=False,
                      grad_scale=grad_scale, found_inf=found_inf)
            if after_run is None:  # one call over every run
                chosen = [self.runs[i] for i in order]
                moments = [self.run_moments[i] for i in order]
                torch._fused_adamw_([r.values for r in chosen], [r.grads for r in chosen], [m for m, _ in moments],
                                    [v for _, v in moments], [], [self.run_steps[i] for i in order], **kw)
            else:
                for i in order:
                    run, (m, v) = self.runs[i], self.run_moments[i]
                    torch._fused_adamw_([run.values], [run.grads], [m], [v], [], [self.run_steps[i]], **kw)
                    after_run(i)
        else:
            for g in groups:
                params = [p for p in g["params"] if p in self.state]
                if not params:
                    continue
                st = [self.state[p] for p in params]
                beta1, beta2 = g["betas"]
                torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in st],
                                    [s["exp_avg_sq"] for s in st], [], [s["step"] for s in st], amsgrad=False,
                                    lr=g["lr"], beta1=beta1, beta2=beta2, weight_decay=g["weight_decay"], eps=g["eps"],
                                    maximize=False, grad_scale=grad_scale, found_inf=found_inf)
            if after_run is not None:
                for i in order:
                    after_run(i)
        if found_inf is not None:
            torch._foreach_sub_(self.run_steps, [found_inf] * len(self.run_steps))
