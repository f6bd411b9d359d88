"""Gathering tensor-parallel gradients back into full tensors, for comparison with one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.parallel_state import shard_specs
from plait.tensor_parallel.sharding import assemble_from_shards


def full_grads(model: nn.Module, tp: GroupInfo) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the full tensor, gathered over the TP group."""
    specs = shard_specs(model)
    every: list = [None] * tp.size
    dist.all_gather_object(every, specs, group=tp.group)
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        g = p.grad.detach()
        if name not in specs:
            out[name] = g.clone()
            continue
        parts = [torch.empty_like(g) for _ in range(tp.size)]
        dist.all_gather(parts, g.contiguous(), group=tp.group)
        out[name] = assemble_from_shards([s[name] for s in every], parts)
    return out
