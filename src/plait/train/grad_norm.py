"""The global gradient norm over every parallel group, computed on the device, and clipping.

Each gradient entry must count exactly once, whatever the layout:

* a TP-sharded parameter contributes its local shard; entries held by several ranks (K/V heads
  under KV replication, ``ShardSpec.replicas`` > 1) are divided by their replica count;
* a TP-replicated parameter (norms, row-parallel biases) is counted on TP rank 0 only;
* data-parallel replicas hold identical, already averaged gradients and are not summed.

The result stays a device tensor: no host synchronisation inside the step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.parallel_state import shard_specs


def global_grad_norm(model: nn.Module, tp: GroupInfo) -> torch.Tensor:
    specs = shard_specs(model)
    total = None
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        spec = specs.get(name)
        if spec is None and tp.rank != 0:
            continue
        sq = p.grad.detach().float().pow(2).sum()
        if spec is not None and spec.replicas > 1:
            sq = sq / spec.replicas
        total = sq if total is None else total + sq
    if total is None:
        total = torch.zeros((), device=next(model.parameters()).device)
    if tp.size > 1:
        dist.all_reduce(total, group=tp.group)
    return total.sqrt()


def clip_by_norm_(model: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by ``min(1, max_norm / norm)`` without reading ``norm`` on the host."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads or max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))
