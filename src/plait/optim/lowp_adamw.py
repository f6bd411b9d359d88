"""AdamW whose weights and moments may live in bf16, with optional stochastic rounding of weights.

Why: fp32 master weights plus two fp32 moments cost 12 bytes per parameter; keeping all three in
bf16 costs 6. The price is precision in the stored values, not in the arithmetic: each step
upcasts the parameter, its gradient and both moments to fp32, does exactly the
``torch.optim.AdamW`` update there, and writes the results back. The moments are written back
with round-to-nearest (their relative error does not accumulate the way a weight's does: they are
exponential averages that forget old rounding). The weight is where round-to-nearest fails: an
update smaller than half the bf16 spacing at the weight is rounded away on every step and the
weight stalls. With ``stochastic_rounding=True`` bf16 weights are written back with
``stochastic_round_to_bf16``, which keeps the update in expectation.

For fp32 parameters nothing is rounded and the result equals ``torch.optim.AdamW`` with
``foreach=False`` (the same operations in the same order).

Randomness: tensor-parallel training keeps replicated parameters (e.g. norm weights) on several
ranks and updates each copy independently from identical gradients; the copies must stay bitwise
equal, so they must round identically. A shared advancing random stream would not guarantee
that (how far it has advanced depends on everything drawn before), so the random bits of one
update depend only on ``(seed, the parameter's step count, group index, index within group)``: a
generator on the parameter's device is re-seeded with a hash of those four numbers before each
parameter's rounding. Replicas therefore need the same ``seed`` and the same position in the
optimizer's parameter list on every rank, which holds when each rank builds its optimizer from the
same model structure. Distinct parameters (and distinct steps) get distinct seeds, so their
roundings are independent.

Host reads: the step count is kept as a Python ``int`` in ``state["step"]``; bias corrections and
the generator seed are computed on the host from it, so a step never reads a device value back
(no ``.item()``), as the training loops here require.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable
from typing import Any

import torch

from plait.optim.stochastic_rounding import stochastic_round_to_bf16


def _rounding_seed(seed: int, step: int, group_index: int, param_index: int) -> int:
    """A 63-bit seed that depends only on its arguments (no process-dependent ``hash()``)."""
    packed = struct.pack("<4q", seed, step, group_index, param_index)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") & ((1 << 63) - 1)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with state stored in each parameter's dtype and fp32 step math.

    ``lr``, ``betas``, ``eps`` and ``weight_decay`` are per-group settings, as in AdamW (schedulers
    change ``param_groups[i]["lr"]``). ``stochastic_rounding`` applies to bf16 parameters only;
    other dtypes are written back with round-to-nearest. ``seed`` fixes the rounding randomness
    (see the module docstring for why it is keyed on parameter position and step). Both are group
    settings too, so a group may opt out of stochastic rounding.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 *, stochastic_rounding: bool = False, seed: int = 0) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        if not -(1 << 63) <= seed < (1 << 63):
            raise ValueError(f"LowPrecisionAdamW: seed is {seed}; it must fit a signed 64-bit integer")
        # The rounding settings are group defaults (not attributes) so that they survive pickling
        # and deepcopy, which keep only defaults, state and param_groups, and travel in state_dict.
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "stochastic_rounding": stochastic_rounding, "seed": seed}
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        """One generator per device, re-seeded per use, so no stream state carries across calls."""
        generators = self.__dict__.setdefault("_generators", {})
        gen = generators.get(device)
        if gen is None:
            gen = generators[device] = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, weight_decay = group["eps"], group["weight_decay"]
            stochastic, seed = group["stochastic_rounding"], group["seed"]
            for param_index, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError("LowPrecisionAdamW: sparse gradients are not supported")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"]
                rounding_seed = _rounding_seed(seed, step, group_index, param_index) if stochastic else None
                self._update(p, grad, state["exp_avg"], state["exp_avg_sq"], step, lr, beta1, beta2, eps,
                             weight_decay, rounding_seed)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                rounding_seed: int | None) -> None:
        """One AdamW update of ``p`` (gradient ``grad``) in fp32, in the order of torch's single-tensor AdamW.

        fp32 tensors are updated in place; lower-precision ones through fp32 copies written back.
        ``rounding_seed`` is None for round-to-nearest, else the seed of the stochastic rounding.
        """
        f32 = torch.float32
        p32 = p if p.dtype == f32 else p.to(f32)
        m32 = exp_avg if exp_avg.dtype == f32 else exp_avg.to(f32)
        v32 = exp_avg_sq if exp_avg_sq.dtype == f32 else exp_avg_sq.to(f32)
        g32 = grad.to(f32)

        if weight_decay != 0:
            p32.mul_(1 - lr * weight_decay)
        m32.lerp_(g32, 1 - beta1)
        v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (v32.sqrt() / bias_correction2_sqrt).add_(eps)
        p32.addcdiv_(m32, denom, value=-step_size)

        if m32 is not exp_avg:
            exp_avg.copy_(m32)
        if v32 is not exp_avg_sq:
            exp_avg_sq.copy_(v32)
        if p32 is not p:
            if rounding_seed is not None and p.dtype == torch.bfloat16:
                p.copy_(stochastic_round_to_bf16(p32, self._generator(p.device, rounding_seed)))
            else:
                p.copy_(p32)


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """Reject settings AdamW would reject, and tensor ``lr`` (its value would need a host read)."""
    if isinstance(lr, torch.Tensor) or not lr >= 0.0:
        raise ValueError(f"LowPrecisionAdamW: lr is {lr!r}; it must be a non-negative float")
    if not eps >= 0.0:
        raise ValueError(f"LowPrecisionAdamW: eps is {eps!r}; it must be >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"LowPrecisionAdamW: betas is {betas!r}; both must be in [0, 1)")
    if not weight_decay >= 0.0:
        raise ValueError(f"LowPrecisionAdamW: weight_decay is {weight_decay!r}; it must be >= 0")
