"""Autograd functions around collectives: each names its forward and its backward.

These are the conjugate pairs of Megatron-style tensor parallelism:

=====================  =====================  ==========================
function               forward                backward
=====================  =====================  ==========================
copy_to_tp  (f)        identity               all-reduce
reduce_from_tp (g)     all-reduce (in place)  identity
scatter_to_tp          split along dim        all-gather along dim
gather_from_tp         all-gather along dim   split along dim
gather_from_sp         all-gather along seq   reduce-scatter along seq
reduce_scatter_to_sp   reduce-scatter seq     all-gather along seq
all_reduce_grad        identity               all-reduce over any group
scale_grad             identity               multiply by a constant
=====================  =====================  ==========================
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plait.comm import primitives as P


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        P.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum), in place when it can be. Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # In place, without a copy of the activation, when autograd allows it. ``mark_dirty`` makes
        # the in-place sum legal: autograd moves ``x``'s history onto this node, and should any
        # earlier node have saved ``x`` for its backward, the version counter that the all-reduce
        # bumps makes that backward raise instead of using the sum. No caller saves it: the
        # inputs are fresh outputs of a linear layer (its backward keeps its input and weight, not
        # its output) or of the vocab-parallel embedding's masked_fill (which keeps the mask).
        # A leaf that requires grad or a view cannot be dirtied like that, and a non-contiguous input
        # is copied by ``contiguous()`` anyway: those three take the copy.
        if x.is_contiguous() and not x._is_view() and not (x.is_leaf and x.requires_grad):
            P.all_reduce(x, group)
            ctx.mark_dirty(x)
            return x
        out = x.contiguous()
        out = out.clone() if out is x else out
        P.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's chunk along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return P.split_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return P.all_gather_dim(grad, ctx.dim, ctx.group), None, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: keep this rank's chunk along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return P.all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return P.split_dim(grad, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    """Forward: all-gather the sequence shards. Backward: reduce-scatter along the sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return P.all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return P.reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence. Backward: all-gather along the sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return P.reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return P.all_gather_dim(grad, ctx.dim, ctx.group), None, None


class _ScaleGrad(torch.autograd.Function):
    """Forward: identity. Backward: multiply the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if P.group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over ``group``; the sum is written into ``x`` itself when it is a contiguous non-leaf
    tensor (callers pass a fresh partial product and must not read it afterwards)."""
    return x if P.group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if P.group_size(group) == 1 else _ScatterToTP.apply(x, dim, group)


def gather_from_tp(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if P.group_size(group) == 1 else _GatherFromTP.apply(x, dim, group)


def gather_from_sp(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if P.group_size(group) == 1 else _GatherFromSP.apply(x, dim, group)


def reduce_scatter_to_sp(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if P.group_size(group) == 1 else _ReduceScatterToSP.apply(x, dim, group)


def all_reduce_grad(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity whose backward sums the gradient over ``group`` (KV-shared groups, SP norms)."""
    return copy_to_tp(x, group)


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)
