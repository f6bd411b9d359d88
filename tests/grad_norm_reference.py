"""The global gradient norm over every parallel group, computed on the device, and clipping.

Each gradient entry must count exactly once, whatever the layout:

* a TP-sharded parameter contributes its local shard; entries held by several ranks (K/V heads
  under KV replication, ``ShardSpec.replicas`` > 1) are divided by their replica count;
* a TP-replicated parameter (norms, row-parallel biases) is counted on TP rank 0 only;
* data-parallel replicas hold identical, already averaged gradients and are not summed;
* pipeline stages each count their own parameters (summed over the PP group), and an embedding
  tied across the first and last stage is counted on the first stage only.

A test reference: the trainer takes the norm from :meth:`DistributedOptimizer.grad_norm`; this
function applies the same counting rule (:func:`plait.parallel_state.norm_share`) to ``.grad`` of
a model without that optimizer, so the tests can compare the two.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.parallel_state import norm_share, shard_specs


def global_grad_norm(model: nn.Module | list[nn.Module], tp: GroupInfo, pp: GroupInfo | None = None) -> torch.Tensor:
    """The L2 norm of every gradient of the model, whatever the TP/PP layout (see module doc).

    ``model`` is the model, or this rank's list of pipeline stages; ``pp`` sums over stages.
    """
    modules = model if isinstance(model, (list, tuple)) else [model]
    total = None
    for module in modules:
        specs = shard_specs(module)
        for name, p in module.named_parameters():
            weight = norm_share(module, name, specs.get(name), tp.rank)
            if p.grad is None or weight == 0:
                continue
            sq = p.grad.detach().float().pow(2).sum()
            total = sq * weight if total is None else total + sq * weight
    if total is None:
        total = torch.zeros((), device=next(modules[0].parameters()).device)
    if tp.size > 1:
        dist.all_reduce(total, group=tp.group)
    if pp is not None and pp.size > 1:
        dist.all_reduce(total, group=pp.group)
    return total.sqrt()


def clip_by_norm_(model: nn.Module | list[nn.Module], norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by ``min(1, max_norm / norm)`` without reading ``norm`` on the host."""
    modules = model if isinstance(model, (list, tuple)) else [model]
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    if not grads or max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))
