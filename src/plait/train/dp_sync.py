"""Data-parallel gradient averaging: one coalesced all-reduce after the last microbatch.

This is the plain, correct baseline (no bucketing, no overlap with backward); it keeps every
layout's loss equal to one process while bucketed, overlapped reduction and ZeRO-1 are built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.comm.primitives import GroupInfo


def average_gradients(model: nn.Module, dp: GroupInfo) -> None:
    if dp.size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = _flatten_dense_tensors(group)
        dist.all_reduce(flat, group=dp.group)
        flat.div_(dp.size)
        for g, synced in zip(group, _unflatten_dense_tensors(flat, group)):
            g.copy_(synced)
