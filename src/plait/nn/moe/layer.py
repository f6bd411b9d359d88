"""The Mixture-of-Experts feed-forward layer: route, dispatch, compute, combine.

Model-agnostic: a family gives the router (kept under Hugging Face's name ``gate``), the
expert class (its projection names) and the sizes. Steps of :meth:`MoELayer.forward` on the
``T`` tokens of a micro-batch:

1. route (fp32): top-k experts and combine weights per token (:mod:`plait.nn.moe.router`);
2. plan: sort the ``T * k`` assignments by expert, apply the capacity if one is set
   (:mod:`plait.nn.moe.dispatch`);
3. compute: the dispatcher runs the experts over the sorted rows (one process: directly; expert
   parallelism swaps in a dispatcher that exchanges the rows between ranks);
4. combine: each output row times its weight, back to token order, summed over the k choices;
   plus the shared expert (when present) on every token;
5. losses: the load-balancing and z-losses reach the gradients through
   :func:`~plait.nn.moe.losses.add_loss_gradient` with the scales the trainer set.

Training knobs are plain attributes (off by default, so a bare model is Hugging Face's
inference computation): ``capacity_factor``, ``aux_loss_scale``, ``z_loss_scale``, ``dispatcher``,
``stats`` (device-side load counters read at logging time), ``load_tracker`` (sees each training
forward's expert counts and says which load shares ``f`` the aux loss uses: the step's running,
all-reduced ones under the global-batch scope; injected by :mod:`plait.moe.step_load`, like the
expert-parallel ``dispatcher``, so this layer holds no collective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from plait.nn.mlp import GatedMLP
from plait.nn.moe.dispatch import DispatchPlan, expert_capacity, plan_dispatch
from plait.nn.moe.experts import ExpertMLP, Experts
from plait.nn.moe.losses import add_loss_gradient, load_balancing_loss, router_z_loss
from plait.nn.moe.router import Routing
from plait.nn.recompute import recomputing

#: ``dispatcher(rows [N, H] sorted by expert, plan, experts) -> [N, H]`` expert outputs in the same order
Dispatcher = Callable[[torch.Tensor, DispatchPlan, Experts], torch.Tensor]
#: ``load_tracker(routed [E] int64 assignments of this forward, tokens T) -> [E]`` fp32 load shares ``f``
#: of the aux loss (assignments per token, no gradient)
LoadTracker = Callable[[torch.Tensor, int], torch.Tensor]


def local_dispatch(rows: torch.Tensor, plan: DispatchPlan, experts: Experts) -> torch.Tensor:
    """Every expert is on this rank: compute directly."""
    return experts(rows, plan.ends)


@dataclass
class MoEStats:
    """Device-side sums over the training forwards since the last read (no host reads):
    ``routed`` ``[E]`` assignments per expert, ``dropped`` assignments, ``aux``/``z`` loss sums,
    ``forwards`` (a host int: how many forwards were summed)."""

    routed: torch.Tensor
    dropped: torch.Tensor
    aux: torch.Tensor
    z: torch.Tensor
    forwards: int = 0

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device) -> MoEStats:
        z = torch.zeros((), device=device)
        return cls(torch.zeros(num_experts, device=device), z.clone(), z.clone(), z.clone())


class MoELayer(nn.Module):
    """Routed experts plus an optional shared expert.

    ``router``: a module mapping ``[T, H]`` to :class:`Routing`; ``expert_cls``: the expert MLP;
    ``shared_intermediate_size`` > 0 adds the shared expert (a gated MLP every token goes through)
    under ``shared_name`` (Qwen2-MoE's ``shared_expert``, DeepSeek's ``shared_experts``), and
    ``shared_expert_gate`` scales it by ``sigmoid(x @ g)`` (Qwen2-MoE style).
    """

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, router: nn.Module, *,
                 expert_cls: type[ExpertMLP] = ExpertMLP, shared_intermediate_size: int = 0,
                 shared_expert_gate: bool = False, shared_name: str = "shared_expert", device=None,
                 dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.hidden_size, self.num_experts = hidden_size, num_experts
        top_k = router.top_k
        assert isinstance(top_k, int), "a router has an int top_k"
        self.top_k = top_k
        self.gate = router
        self.experts = Experts(num_experts, hidden_size, intermediate_size, expert_cls, **kw)
        #: the attribute name of the shared expert (``None``: the layer has none)
        self.shared_name = shared_name if shared_intermediate_size else None
        if shared_intermediate_size:
            setattr(self, shared_name, GatedMLP(hidden_size, shared_intermediate_size, **kw))
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **kw)
        self.capacity_factor: float | None = None
        self.aux_loss_scale = 0.0
        self.z_loss_scale = 0.0
        self.dispatcher: Dispatcher = local_dispatch
        self.stats: MoEStats | None = None
        self.load_tracker: LoadTracker | None = None

    def route(self, flat: torch.Tensor) -> tuple[Routing, DispatchPlan]:
        routing: Routing = self.gate(flat)
        capacity = None if self.capacity_factor is None else expert_capacity(
            flat.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        return routing, plan_dispatch(routing.experts, routing.weights, self.num_experts, capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing, plan = self.route(flat)
        rows = flat[plan.tokens]
        if plan.kept is not None:
            rows = torch.where(plan.kept.unsqueeze(-1), rows, 0)
        out = self.dispatcher(rows, plan, self.experts)
        weights = routing.weights.reshape(-1)[plan.order]
        if plan.kept is not None:
            weights = weights * plan.kept
            out = torch.where(plan.kept.unsqueeze(-1), out, 0)
        out = (out.float() * weights.unsqueeze(-1)).to(x.dtype)
        per_choice = torch.zeros_like(out).index_copy(0, plan.order, out)
        y = per_choice.view(-1, self.top_k, shape[-1]).sum(dim=1)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(flat)
            if hasattr(self, "shared_expert_gate"):
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            y = y + shared
        y = self._losses(y, routing, plan)
        return y.view(shape)

    def _losses(self, y: torch.Tensor, routing: Routing, plan: DispatchPlan) -> torch.Tensor:
        want_stats = self.training and self.stats is not None and not recomputing()  # counted once
        tracker = self.load_tracker if self.training and torch.is_grad_enabled() else None  # training forwards only
        if not (self.aux_loss_scale or self.z_loss_scale or want_stats or tracker is not None):
            return y
        share = None if tracker is None else tracker(plan.routed, routing.probs.shape[0])
        aux = load_balancing_loss(routing.probs, routing.experts, plan.routed, share=share)
        z = router_z_loss(routing.logits)
        if want_stats and self.stats is not None:
            s = self.stats
            s.routed += plan.routed.detach()
            s.dropped += plan.dropped.detach()
            s.aux += aux.detach()
            s.z += z.detach()
            s.forwards += 1
        y = add_loss_gradient(y, aux, self.aux_loss_scale)
        return add_loss_gradient(y, z, self.z_loss_scale)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}"
