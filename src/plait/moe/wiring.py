"""Turns the recipe's ``moe`` section into the MoE layers' training settings.

The layers' load-balancing and z-losses reach the gradients from inside each layer's backward
(:func:`plait.nn.moe.add_loss_gradient`), so their weights carry the trainer's normalisation:
the runtime divides each micro-batch's loss by the micro-batch count and data parallelism averages
the gradients, hence ``coef / (microbatches * moe_layers)`` per layer and micro-batch makes the
step's objective ``loss + coef * mean over micro-batches, ranks and MoE layers of the per-layer
loss``. Pipeline stages need nothing more: each adds its own layers' gradients, and a stage
without MoE layers adds none.

``moe.dispatch: exact`` swaps the expert-parallel layers' static all-to-all for the exact-volume one
(:mod:`plait.moe.exact_dispatch`). ``moe.router: sigmoid`` replaces each layer's router by a sigmoid
one over the same weight (before
the optimizer and a checkpoint restore see the model); the global-batch scope and the sigmoid
router's bias update also need each step's load over the data-parallel replicas, which
:func:`plait.moe.step_load.attach_load_balancing` adds (the trainer calls it, after this).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.moe.exact_dispatch import ExactAllToAllDispatcher
from plait.moe.expert_parallel import AllToAllDispatcher
from plait.moe.section import MoeSection
from plait.nn.moe import MoELayer, MoEStats, SigmoidTopKRouter, sigmoid_router_from


def moe_layers(modules: Iterable[nn.Module]) -> list[tuple[str, MoELayer]]:
    """``(qualified name, layer)`` of every MoE layer in ``modules`` (stages), in order."""
    return [(name, m) for module in modules for name, m in module.named_modules() if isinstance(m, MoELayer)]


def configure_moe(stages: list[nn.Module], section: MoeSection, config: Any, *, microbatches: int,
                  stats: bool = True, sequence_shards: int = 1) -> list[tuple[str, MoELayer]]:
    """Set every MoE layer of ``stages`` from ``section`` (a no-op for a dense model); returns them.

    ``sequence_shards``: the TP degree under sequence parallelism (each rank's layers see a
    ``1 / sequence_shards`` shard of the micro-batch's tokens; see :mod:`plait.moe.sequence_parallel`).
    """
    layers = moe_layers(stages)
    if not layers:
        return layers
    count = len(config.moe_layer_ids())  # over the whole model, not this rank's stages
    coef = section.aux_loss_coef if section.aux_loss_coef is not None else config.router_aux_loss_coef
    for _, layer in layers:
        layer.aux_loss_scale = coef / (microbatches * count * sequence_shards)
        layer.z_loss_scale = section.z_loss_coef / (microbatches * count * sequence_shards)
        layer.capacity_factor = section.capacity_factor
        if section.dispatch == "exact" and isinstance(layer.dispatcher, AllToAllDispatcher):
            layer.dispatcher = ExactAllToAllDispatcher(layer.dispatcher.ep)
        if section.router == "sigmoid" and not isinstance(layer.gate, SigmoidTopKRouter):
            layer.gate = sigmoid_router_from(layer.gate, num_groups=section.router_groups,
                                             topk_groups=section.router_topk_groups)
        if layer.aux_loss_scale and (section.aux_loss_scope == "global_batch" or sequence_shards > 1):
            layer.load_tracker = _unattached  # attach_load_balancing gives it the step's counter
        if stats:
            device = next(layer.parameters()).device
            layer.stats = MoEStats.zeros(layer.num_experts, device)
    return layers


def _unattached(routed: torch.Tensor, tokens: int) -> torch.Tensor:
    raise RuntimeError("moe.aux_loss_scope=global_batch and sequence parallelism need the step's load counter: call "
                       "plait.moe.step_load.attach_load_balancing after configure_moe and its start_step() "
                       "before each step")


@torch.no_grad()
def read_moe_stats(layers: list[tuple[str, MoELayer]], group: Any = None,
                   world: int = 1) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The interval's MoE metrics, then the counters reset: per layer (``moe/<layer>/...``) the
    load imbalance (max / mean assignments per expert), the dropped share of assignments, and the
    mean aux and z-loss per forward, and for a sigmoid router the spread (max - min) of its expert
    bias. Second: each layer's per-expert share of the assignments (for the load map).

    One host read for all of this rank's layers; with ``world > 1`` every rank of ``group`` (all
    ranks) must call it. The ranks' raw sums (assignments per expert, drops, loss sums, forwards)
    are added before any ratio is formed, so the figures are those of every token the layer saw in
    the interval, whatever the layout: data-parallel replicas and, under sequence parallelism, TP
    ranks route different tokens and add theirs; TP ranks without sequence parallelism count the
    same tokens ``tp`` times, which scales every sum alike and changes no ratio; pipeline stages
    hold different layers.
    """
    local = _local_sums(layers)
    parts: list[dict[str, list[float]] | None] = [local]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, local, group=group)
    totals: dict[str, list[float]] = {}
    for part in parts:
        for name, sums in (part or {}).items():
            if name not in totals:
                totals[name] = list(sums)
            else:
                totals[name][:-1] = [a + b for a, b in zip(totals[name][:-1], sums[:-1], strict=True)]
    metrics: dict[str, float] = {}
    shares: dict[str, list[float]] = {}
    for name, (*routed, dropped, aux, z, forwards, bias_range) in totals.items():
        total = max(sum(routed), 1.0)
        metrics[f"moe/{name}/imbalance"] = max(routed) / max(sum(routed) / len(routed), 1e-9)
        metrics[f"moe/{name}/dropped"] = dropped / total
        metrics[f"moe/{name}/aux_loss"] = aux / forwards
        metrics[f"moe/{name}/z_loss"] = z / forwards
        if bias_range == bias_range:  # NaN: not a sigmoid router
            metrics[f"moe/{name}/bias_range"] = bias_range
        shares[name] = [r / total for r in routed]
    return metrics, shares


def _local_sums(layers: list[tuple[str, MoELayer]]) -> dict[str, list[float]]:
    """Per layer (short name ``layerN``): ``[assignments per expert..., dropped, aux sum, z sum,
    forwards, bias spread (NaN without a sigmoid router)]`` since the last read, then the counters
    reset; the last entry is a state, not a sum (equal on every rank holding the layer)."""
    names, rows = [], []
    for name, layer in layers:
        s = layer.stats
        if s is None or s.forwards == 0:
            continue
        if isinstance(layer.gate, SigmoidTopKRouter):  # how far the load-balancing bias has moved apart
            bias = layer.gate.expert_bias
            spread = (bias.max() - bias.min()).float()
        else:
            spread = torch.tensor(float("nan"), device=s.routed.device)
        forwards = torch.tensor(float(s.forwards), device=s.routed.device)
        rows.append(torch.cat([s.routed.float(), torch.stack([s.dropped.float(), s.aux.float(), s.z.float(),
                                                              forwards, spread])]))
        # model.layers.3.mlp -> layer3; a prediction module's block, mtp.0.mlp -> mtp0
        names.append(name.replace("model.layers.", "layer").replace("mtp.", "mtp").split(".")[0])
        layer.stats = MoEStats.zeros(layer.num_experts, s.routed.device)
    if not rows:
        return {}
    read = torch.cat(rows).tolist()  # the one host read
    out, at = {}, 0
    for name, row in zip(names, rows, strict=True):
        out[name] = read[at:at + row.numel()]
        at += row.numel()
    return out
