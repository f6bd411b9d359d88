"""Point-to-point transfers around the context-parallel ring (no autograd, no attention).

:meth:`RingExchange.start` posts, in one ``dist.batch_isend_irecv``, a send of each tensor to the
rank ``direction`` steps ahead and a receive of a tensor of the same shape from the rank behind, and
returns at once; the caller computes with the block at hand and calls :meth:`Pending.wait` before it
needs the received tensors. With ``overlap=False`` the transfer is waited for inside ``start`` (the
benchmark's "no overlap" case). Every rank posts its operations in the same order and each message
kind has its own tag, so transfers between the same two ranks (``cp = 2``) cannot cross.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.comm.primitives import GroupInfo


@dataclass
class Pending:
    """Transfers in flight; ``wait()`` returns the received tensors (in the order sent)."""

    works: list
    received: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        return self.received


class RingExchange:
    """The ring of one cp group: ``ranks`` are its global ranks in ring order (the mesh's cp group)."""

    def __init__(self, info: GroupInfo, ranks: list[int], *, overlap: bool = True) -> None:
        if len(ranks) != info.size:
            raise ValueError(f"ranks={ranks} does not match the cp group size {info.size}")
        self.info, self.ranks, self.overlap = info, ranks, overlap

    def peer(self, offset: int) -> int:
        """Global rank ``offset`` places along the ring from this rank."""
        return self.ranks[(self.info.rank + offset) % self.info.size]

    def start(self, tensors: list[torch.Tensor], direction: int, tags: list[int]) -> Pending:
        """Send ``tensors`` to the rank ``direction`` ahead; receive as many from the rank behind."""
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, r, tag in zip(tensors, received, tags, strict=True):
            ops.append(dist.P2POp(dist.isend, t, self.peer(direction), self.info.group, tag))
            ops.append(dist.P2POp(dist.irecv, r, self.peer(-direction), self.info.group, tag))
        pending = Pending(dist.batch_isend_irecv(ops), received)
        if not self.overlap:
            pending.wait()
        return pending
