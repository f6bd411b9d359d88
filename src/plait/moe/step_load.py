"""The step's expert load: the global-batch load shares of the auxiliary loss, and the sigmoid
router's expert-bias update after each optimizer step.

Both need one thing the model-agnostic layer must not do itself, a collective over the ranks that
route *different tokens through the same layer*: the data-parallel replicas of the step, i.e. the
``dp_cp`` group (``dp`` includes the expert-parallel ranks, which are data-parallel for routing;
``cp`` ranks route other positions of the same sequences; TP ranks route the same tokens and
pipeline stages hold other layers, so neither is in the group). Under sequence parallelism TP
ranks route different shards of the same micro-batch: each forward's counts are first summed over
the TP group (:mod:`plait.moe.sequence_parallel`), under either scope. :class:`StepLoad` is injected
into each :class:`~plait.nn.moe.MoELayer` as its ``load_tracker`` (the way expert parallelism
injects its all-to-all dispatcher) and sees each training forward's per-expert assignment counts.

Global-batch aux loss (``moe.aux_loss_scope: global_batch``, Megatron-LM's "global aux loss"):
in the forward of micro-batch ``m`` of a step, the layer's ``f_i`` is

    f_i = (sum over micro-batches 1..m of this step and over the replicas of the assignments to
           expert i) / (the same sum of tokens)

a running share, reset at each step start, summed over replicas by one device all-reduce of
``[E + 1]`` integers per layer and micro-batch (no host read). ``P_i``, the mean router
probability, stays the local micro-batch's and carries the gradient, and the loss keeps its
weight ``coef / (micro-batches * MoE layers)`` and the data-parallel mean of the gradients. So a
step of one process with micro-batch ``dp * B`` gives the same gradients as ``dp`` replicas with
micro-batch ``B`` each (the mean over replicas of ``E sum f P_local`` is ``E sum f P_all``).
The last micro-batch's ``f`` is the whole step's; earlier ones see the step so far (a pipeline
schedule runs micro-batch 1's backward before the last forward, so nothing else is causal).

Expert bias (``moe.router: sigmoid``): after the optimizer step, ``bias_i += rate * sign(mean_j
load_j - load_i)`` with ``load`` the step's assignments summed over micro-batches and replicas
(the global shares' running sum when that exists, otherwise one all-reduce of every layer's
local sums at the step's end), so every replica keeps the same bias. A step whose gradient norm is
not finite moves no bias (the decision stays on the device).

Activation checkpointing recomputes a layer's forward inside the backward. The recomputation must
use the ``f`` of the original forward, not the running sum as it is by then, and must neither
count nor communicate again: :func:`recomputing` tells the two apart (a forward that runs while
the autograd engine executes a graph task), and each layer replays its recorded shares in
forward order (the backward of a layer's micro-batches runs in forward order under every
schedule plait has).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.moe.section import MoeSection
from plait.nn.moe import MoELayer, SigmoidTopKRouter, update_expert_bias
from plait.nn.recompute import recomputing


class StepLoad:
    """One MoE layer's load over the current step; its ``load_tracker`` (see the module docstring).

    ``running`` ``[E + 1]`` (int64): assignments per expert, then tokens, over this step's training
    forwards so far, summed in each forward over ``groups`` (in order: the TP group under sequence
    parallelism, whose ranks route the shards of one micro-batch; then, for the global share, the
    ``dp_cp`` replicas). ``global_share``: the aux loss's ``f`` is the running share rather than this
    forward's. ``microbatches`` bounds the forwards of one step, so a loop that never calls
    :meth:`start` fails instead of silently counting over several steps.
    """

    def __init__(self, num_experts: int, device: torch.device, groups: tuple[GroupInfo, ...] = (), *,
                 global_share: bool, microbatches: int) -> None:
        self.num_experts, self.global_share, self.microbatches = num_experts, global_share, microbatches
        self.groups = tuple(g for g in groups if g.size > 1)
        self.running = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
        self.forwards = 0
        self._recorded: deque[torch.Tensor] = deque()

    def start(self) -> None:
        """A new step: the running sums restart from zero."""
        self.running.zero_()
        self.forwards = 0
        self._recorded.clear()

    @property
    def replays(self) -> bool:
        """Whether a recomputation must replay the recorded share (it was communicated or running)."""
        return self.global_share or bool(self.groups)

    @torch.no_grad()
    def __call__(self, routed: torch.Tensor, tokens: int) -> torch.Tensor:
        if recomputing():  # the original forward counted (and communicated) already
            return self._recorded.popleft() if self.replays else routed.float() / tokens
        self.forwards += 1
        if self.forwards > self.microbatches:
            raise RuntimeError(f"an MoE layer ran {self.forwards} training forwards in one step of "
                               f"{self.microbatches} micro-batches: the step's load was not reset (call "
                               f"LoadBalancing.start_step() before each step)")
        local = torch.cat([routed.to(torch.int64), routed.new_full((1,), tokens, dtype=torch.int64)])
        for group in self.groups:
            dist.all_reduce(local, group=group.group)
        self.running += local
        counted = self.running if self.global_share else local
        share = (counted[:-1].double() / counted[-1].double()).float()
        if self.replays:
            self._recorded.append(share)
        return share


class LoadBalancing:
    """The trainer's per-step hooks of a rank's MoE layers: :meth:`start_step` before the step's
    first forward, :meth:`finish_step` after its optimizer step."""

    def __init__(self, layers: list[MoELayer], trackers: list[StepLoad], replicas: GroupInfo | None,
                 rate: float) -> None:
        # the trackers' running sums already include the TP shards (sequence parallelism) and, for the
        # global share, the replicas; step_loads adds the replicas otherwise
        self.layers, self.trackers, self.replicas, self.rate = layers, trackers, replicas, rate

    def start_step(self) -> None:
        for tracker in self.trackers:
            tracker.start()

    @torch.no_grad()
    def step_loads(self) -> list[torch.Tensor]:
        """Each layer's ``[E]`` assignments of the step, summed over micro-batches and replicas."""
        if not self.trackers:
            return []
        if self.trackers[0].global_share:  # the running sums are already the replicas'
            return [t.running[:-1] for t in self.trackers]
        flat = torch.cat([t.running[:-1] for t in self.trackers])
        if self.replicas is not None and self.replicas.size > 1:
            dist.all_reduce(flat, group=self.replicas.group)  # every layer in one collective
        return list(flat.split([t.num_experts for t in self.trackers]))

    @torch.no_grad()
    def finish_step(self, grad_norm: torch.Tensor | None = None) -> None:
        """Move the sigmoid routers' expert biases by the step's load (nothing for softmax routers).
        ``grad_norm``: the step's; when it is not finite no bias moves."""
        routers = [layer.gate for layer in self.layers]
        if self.rate == 0 or not any(isinstance(r, SigmoidTopKRouter) for r in routers):
            return
        enabled = None if grad_norm is None else torch.isfinite(grad_norm)
        for router, load in zip(routers, self.step_loads(), strict=True):
            if isinstance(router, SigmoidTopKRouter):
                update_expert_bias(router, load, self.rate, enabled=enabled)


def attach_load_balancing(stages: Iterable[nn.Module], section: MoeSection, replicas: GroupInfo | None, *,
                          microbatches: int, sequence: GroupInfo | None = None) -> LoadBalancing | None:
    """Give every MoE layer of ``stages`` (set up by :func:`plait.moe.configure_moe`) a
    :class:`StepLoad` over ``replicas`` (the ``dp_cp`` group; ``None``: one process) when it needs
    one: the global-batch aux loss, a sigmoid router, or an aux loss under sequence parallelism
    (``sequence``: the TP group then, whose ranks route shards of the same micro-batch). Returns
    the step hooks, or ``None`` when no layer of this rank needs them (a dense model, a stage
    without MoE layers, micro-batch scope with softmax routers and no sequence shards)."""
    layers = [m for stage in stages for m in stage.modules() if isinstance(m, MoELayer)]
    aux = any(layer.aux_loss_scale for layer in layers)
    global_share = section.aux_loss_scope == "global_batch" and aux
    biased = any(isinstance(layer.gate, SigmoidTopKRouter) for layer in layers)
    sharded = sequence is not None and sequence.size > 1
    if not (global_share or biased or (sharded and aux)):
        return None
    groups = ((sequence,) if sharded and sequence is not None else ()) + (
        (replicas,) if global_share and replicas is not None else ())
    trackers = []
    for layer in layers:
        device = next(layer.parameters()).device
        tracker = StepLoad(layer.num_experts, device, groups, global_share=global_share, microbatches=microbatches)
        layer.load_tracker = tracker
        trackers.append(tracker)
    return LoadBalancing(layers, trackers, replicas, section.router_bias_update_rate)
