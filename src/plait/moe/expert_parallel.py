"""Expert parallelism: each rank of an expert group holds ``E / ep`` experts and the tokens travel
to them by all-to-all.

Which rank holds what: expert-group rank ``q`` holds experts ``q * E/ep .. (q+1) * E/ep - 1``
(a contiguous range, under their global names, so checkpoints and logs see the usual names).
The builder (:mod:`plait.materialize`) applies :func:`apply_expert_parallel` to the model while it
is still on the meta device, so a rank never allocates, initialises or reads from a Hugging Face
directory any expert but its own.

The dispatch, with ``N = T * k`` assignments on each rank (sorted by global expert by the layer's
plan) and ``slot = N`` rows reserved per peer (the most one rank can send to one peer, so the
shapes never depend on the routing and no count is read on the host):

1. send: row ``i`` (of expert ``e``, peer ``p = e // (E/ep)``) goes to row ``p * slot + j`` of the
   send buffer, ``j`` its rank among the rows for ``p``; dropped rows go nowhere;
2. the per-expert counts ``[ep, E/ep]`` are exchanged by an all-to-all on the device;
3. the rows are exchanged; the receiver regroups them by local expert (:func:`receive_plan`,
   a pure function of the received counts) and runs its experts over them;
4. the outputs go back by the reverse exchange into the sender's sorted order.

The price of a static shape is memory and volume: ``ep * slot`` rows per exchange instead of
``N``, mostly padding. Tensor parallelism inside experts is not implemented (experts are whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.moe.all_to_all import all_to_all, exchange
from plait.nn.moe import DispatchPlan, Experts, MoELayer


@dataclass
class ReceivePlan:
    """How the rows received from ``ep`` peers (``slot`` each) are grouped by local expert:
    ``order`` ``[ep * slot]`` received row at each grouped position, valid rows first; ``ends``
    (int32) ``[E_local]`` the run ends; rows at positions ``>= ends[-1]`` are padding."""

    order: torch.Tensor
    ends: torch.Tensor


def receive_plan(counts: torch.Tensor, slot: int) -> ReceivePlan:
    """The grouping of received rows from ``counts`` ``[ep, E_local]`` (rows peer ``s`` sent for
    each local expert, in expert order, at the start of its slot)."""
    ep, local = counts.shape
    j = torch.arange(slot, device=counts.device)
    bounds = torch.cumsum(counts, dim=1)  # [ep, E_local]
    expert = torch.searchsorted(bounds, j.expand(ep, slot).contiguous(), right=True)  # == local: padding
    order = torch.argsort(expert.reshape(-1), stable=True)
    ends = torch.cumsum(counts.sum(dim=0), 0).to(torch.int32)
    return ReceivePlan(order=order, ends=ends)


def send_positions(plan: DispatchPlan, ep: int) -> torch.Tensor:
    """``[N]``: the send-buffer row of each sorted assignment (``ep * slot`` for a dropped one)."""
    n = plan.order.numel()
    local = plan.counts.numel() // ep
    i = torch.arange(n, device=plan.order.device)
    expert = torch.searchsorted(plan.ends, i.to(plan.ends.dtype), right=True)  # == E past the last run
    per_peer = plan.counts.view(ep, local).sum(dim=1)
    peer_start = torch.cumsum(per_peer, 0) - per_peer
    peer = torch.div(expert, local, rounding_mode="floor").clamp(max=ep - 1)
    dest = peer * n + (i - peer_start[peer])
    return torch.where(expert < plan.counts.numel(), dest, ep * n)


class AllToAllDispatcher:
    """A :data:`~plait.nn.moe.layer.Dispatcher` exchanging rows over the expert group ``ep``."""

    def __init__(self, ep: GroupInfo) -> None:
        self.ep = ep

    def __call__(self, rows: torch.Tensor, plan: DispatchPlan, experts: Experts) -> torch.Tensor:
        ep, group = self.ep.size, self.ep.group
        n, hidden = rows.shape
        dest = send_positions(plan, ep)
        send = rows.new_zeros(ep * n + 1, hidden).index_copy(0, dest, rows)[:-1]
        counts = exchange(plan.counts.view(ep, -1), group)
        recv = all_to_all(send, group)
        grouped = receive_plan(counts, n)
        local = experts(recv[grouped.order], grouped.ends)
        valid = torch.arange(ep * n, device=rows.device) < grouped.ends[-1]
        local = torch.where(valid.unsqueeze(-1), local, 0)
        back = all_to_all(torch.zeros_like(local).index_copy(0, grouped.order, local), group)
        return torch.cat([back, back.new_zeros(1, hidden)])[dest]


def moe_layers_of(modules: list[nn.Module]) -> list[MoELayer]:
    return [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]


def local_experts(num_experts: int, ep: GroupInfo) -> range:
    """The global indices of the experts expert-group rank ``ep.rank`` holds (a contiguous range)."""
    if num_experts % ep.size:
        raise ValueError(f"parallel.ep={ep.size} does not divide the {num_experts} experts of a layer")
    local = num_experts // ep.size
    return range(ep.rank * local, (ep.rank + 1) * local)


def apply_expert_parallel(stages: list[nn.Module], ep: GroupInfo) -> None:
    """Keep this rank's experts in every MoE layer of ``stages`` and exchange tokens over ``ep``
    (nothing to do at ``ep.size == 1``).

    Works on the meta device (how the builder calls it: the other experts are then never
    allocated) as well as on an allocated model, and applying it twice changes nothing.
    """
    if ep.size == 1:
        return
    for layer in moe_layers_of(stages):
        layer.experts.keep_only(local_experts(layer.num_experts, ep))
        layer.dispatcher = AllToAllDispatcher(ep)


def expert_parameter_names(stages: list[nn.Module]) -> frozenset[str]:
    """Qualified names (in the stage that holds them) of every routed expert's parameters."""
    names = set()
    for stage in stages:
        for prefix, module in stage.named_modules():
            if isinstance(module, Experts):
                names |= {f"{prefix}.{n}" for n, _ in module.named_parameters()}
    return frozenset(names)
