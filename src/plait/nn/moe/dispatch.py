"""The dispatch plan: where each (token, choice) assignment goes, as data.

A pure function of the router's choice, tested without a model: the ``T * k`` assignments are
sorted by expert (stable, so within an expert they keep token order), which makes every expert's
tokens one contiguous run for a grouped matmul. Everything stays on the device: no counts are read
on the host, so a step launches without waiting for the router.

Capacity (optional): expert ``e`` accepts at most ``capacity`` assignments per micro-batch. Drop
policy: an over-full expert keeps the assignments with the highest combine weight (ties in token
order) and drops the rest; a dropped assignment contributes zero to its token's output (the token
still flows through the residual connection, and its other choices still count). Dropped
assignments are moved after every kept one, past the last group's end, and the computation masks
them out, so the shapes stay static.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.nn.moe.losses import assignments_per_expert


@dataclass
class DispatchPlan:
    """``order`` ``[N]``: the flat assignment index (``token * k + slot``) at each sorted position;
    ``tokens`` ``[N]``: the token of each sorted position; ``ends`` ``[E]`` (int32): cumulative
    end of each expert's run (what ``torch._grouped_mm`` takes as ``offs``); ``counts`` ``[E]``:
    kept assignments per expert; ``routed`` ``[E]``: assignments the router made per expert
    (before capacity); ``kept`` ``[N]`` bool in sorted order, or ``None`` when nothing can drop."""

    order: torch.Tensor
    tokens: torch.Tensor
    ends: torch.Tensor
    counts: torch.Tensor
    routed: torch.Tensor
    kept: torch.Tensor | None

    @property
    def dropped(self) -> torch.Tensor:
        """Assignments dropped by the capacity (a device scalar, int64)."""
        return self.routed.sum() - self.counts.sum()


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * tokens * top_k / num_experts)``: assignments one expert accepts."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def plan_dispatch(experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                  capacity: int | None = None) -> DispatchPlan:
    """The plan of ``experts`` ``[T, k]`` with combine ``weights`` ``[T, k]``; ``capacity`` per expert
    (``None``: dropless)."""
    top_k = experts.shape[-1]
    flat = experts.reshape(-1)
    routed = assignments_per_expert(flat, num_experts)
    if capacity is None:
        order = torch.argsort(flat, stable=True)
        counts, kept = routed, None
    else:
        # by weight (descending), then stably by expert: each expert's run lists its heaviest first
        by_weight = torch.argsort(weights.reshape(-1), descending=True, stable=True)
        by_expert = by_weight[torch.argsort(flat[by_weight], stable=True)]
        starts = torch.cumsum(routed, 0) - routed
        rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[by_expert]]
        keep = rank < capacity
        # kept assignments first (grouped by expert, heaviest first), dropped ones after them all
        key = torch.where(keep, flat[by_expert], num_experts)
        regroup = torch.argsort(key, stable=True)
        order, kept = by_expert[regroup], keep[regroup]
        counts = routed.clamp(max=capacity)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    return DispatchPlan(order=order, tokens=torch.div(order, top_k, rounding_mode="floor"), ends=ends,
                        counts=counts, routed=routed, kept=kept)
