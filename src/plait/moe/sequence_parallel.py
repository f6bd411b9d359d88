"""MoE layers under sequence parallelism: each TP rank routes and computes its own sequence shard.

With ``parallel.sequence_parallel`` the residual stream a block hands its MoE layer is a sequence
shard (``S / tp`` positions), so each TP rank routes only its tokens and runs the (whole,
replicated) experts over them: no expert work is repeated over the TP group, unlike TP without
SP, where every TP rank computes the same tokens. Three things keep the step equal to one
process's:

1. **Parameter gradients are summed over the TP group.** The router, expert and shared-expert
   weights are replicated like a sequence-parallel norm's, but each rank's gradient covers only its
   tokens. :func:`sum_moe_gradients_over_tp` gives every such parameter a gradient hook (it runs
   before the gradient is accumulated, so data-parallel bucket hooks and ZeRO-1 see the sum). The
   layer is model-agnostic and holds no collective; the hook is the distributed part, added by
   the builder after the parameters are allocated.
2. **The load-balancing share ``f`` is the whole micro-batch's.** Each rank's forward sums its
   per-expert assignment counts over the TP group (:mod:`plait.moe.step_load`, one all-reduce of
   ``E + 1`` integers per layer and micro-batch), while ``P`` (the mean router probability, which
   carries the gradient) stays the shard's.
3. **The aux and z-loss weights are divided by ``tp``.** Both losses are means over tokens; a
   shard's mean moves each of its tokens by ``1 / (S / tp)`` where the micro-batch's would move it
   by ``1 / S``, and the TP sum of (1) adds the ranks' router gradients. With ``f`` global,
   ``sum over ranks of (E * sum_i f_i * P_i(shard)) / tp`` is exactly the micro-batch's aux loss
   (equal shards), and likewise the z-loss (:func:`plait.moe.configure_moe` applies the factor).

A capacity factor is refused with sequence parallelism (:mod:`plait.config.rules.moe`): each rank
would drop assignments by its shard's ranking instead of the micro-batch's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.nn.moe import MoELayer


def sum_moe_gradients_over_tp(stages: Iterable[nn.Module], tp: GroupInfo) -> int:
    """Sum the gradient of every trainable MoE-layer parameter of ``stages`` over ``tp`` (sequence
    parallelism; nothing to do when ``tp.size == 1``); returns how many parameters were hooked.

    Call once, after the parameters are allocated (a hook lives on its parameter object). The hooks
    fire in the same order on every rank of the TP group, since the ranks run the same graph.
    """
    if tp.size == 1:
        return 0
    hooked = 0
    for stage in stages:
        for layer in stage.modules():
            if not isinstance(layer, MoELayer):
                continue
            for p in layer.parameters():
                if p.requires_grad and not p.is_meta:  # a planner's meta model never runs a backward
                    p.register_hook(_summed_over(tp))
                    hooked += 1
    return hooked


def _summed_over(tp: GroupInfo):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=tp.group)
        return total
    return hook
