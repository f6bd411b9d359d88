"""The all-to-all of expert parallelism, as an autograd function.

Every rank sends the same number of rows to every peer (``x`` ``[ep * slot, ...]``: block ``p``
goes to peer ``p``, block ``s`` of the result came from peer ``s``), so no split sizes travel to
the host. The backward of such an exchange is the same exchange of the gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return exchange(grad, ctx.group), None


def exchange(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split ``all_to_all_single`` of ``x`` over ``group`` (no autograd)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable equal-split all-to-all of ``x`` (first dimension divisible by the group size)."""
    return _AllToAll.apply(x, group)
