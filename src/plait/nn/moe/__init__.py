"""Mixture-of-Experts building blocks: routers, dispatch plan, experts, losses and the layer.

Model-agnostic and free of distributed code: a family composes :class:`MoELayer` from these,
and expert parallelism (:mod:`plait.moe`) only swaps the layer's ``dispatcher`` and trims its
:class:`Experts` to the rank's share.
"""

from plait.nn.moe.dispatch import DispatchPlan, expert_capacity, plan_dispatch
from plait.nn.moe.experts import ExpertMLP, Experts
from plait.nn.moe.grouped import grouped_mm, grouped_mm_usable
from plait.nn.moe.layer import LoadTracker, MoELayer, MoEStats, local_dispatch
from plait.nn.moe.losses import add_loss_gradient, assignments_per_expert, load_balancing_loss, router_z_loss
from plait.nn.moe.router import Routing, SigmoidTopKRouter, SoftmaxTopKRouter, sigmoid_router_from, update_expert_bias

__all__ = ["DispatchPlan", "ExpertMLP", "Experts", "LoadTracker", "MoELayer", "MoEStats", "Routing",
           "SigmoidTopKRouter", "SoftmaxTopKRouter", "add_loss_gradient", "assignments_per_expert",
           "expert_capacity", "grouped_mm", "grouped_mm_usable", "load_balancing_loss", "local_dispatch",
           "plan_dispatch", "router_z_loss", "sigmoid_router_from", "update_expert_bias"]
