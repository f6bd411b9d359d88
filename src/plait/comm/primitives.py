"""Plain (non-autograd) collectives along an arbitrary tensor dimension.

``torch.distributed`` gathers and scatters along dim 0; these helpers move the wanted dim to the
front, call the collective, and move it back. Every helper is a no-op for a 1-rank group, so the
same code path serves the unsharded reference.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist

from plait.comm.trace import entered

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> dist.Work | None:
    """Sum ``x`` in place over ``group``; returns the work handle when ``async_op``."""
    if group_size(group) == 1:
        return None
    entered("all_reduce", group)
    return dist.all_reduce(x, group=group, async_op=async_op)


def all_gather_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate the equal-shaped ``x`` of every rank along ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * front.shape[0],) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    entered("all_gather", group)
    all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


@overload
def reduce_scatter_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
                       async_op: Literal[False] = False) -> torch.Tensor: ...


@overload
def reduce_scatter_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
                       async_op: Literal[True]) -> tuple[torch.Tensor, dist.Work | None]: ...


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
                       async_op: bool = False) -> torch.Tensor | tuple[torch.Tensor, dist.Work | None]:
    """Sum ``x`` over ranks and keep this rank's equal chunk along ``dim``.

    With ``async_op`` returns ``(result, work)``; the result is valid after ``work.wait()``.
    """
    n = group_size(group)
    if n == 1:
        return (x, None) if async_op else x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n,) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    entered("reduce_scatter", group)
    work = reduce_scatter_single(out, front, group=group, async_op=async_op)
    result = out.movedim(0, dim)
    return (result, work) if async_op else result


def split_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's equal chunk of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


class GroupInfo:
    """A process group with this rank's position in it.

    ``group`` may be ``None`` for a single-rank group, or when the mesh was built without process
    groups (shape planning): then ``rank`` and ``size`` still describe the layout but no
    collective may be called.
    """

    __slots__ = ("group", "rank", "size")

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    @staticmethod
    def single() -> GroupInfo:
        return GroupInfo(None, 0, 1)

    def __repr__(self) -> str:
        return f"GroupInfo(rank={self.rank}, size={self.size})"
