"""How a sequence is cut over the context-parallel (cp) ranks.

The sequence of ``S`` tokens is cut into ``2 * cp`` equal chunks of ``n = S / (2 * cp)`` tokens and
each rank holds two of them, one after the other, as its local sequence of ``2n`` tokens:

* ``zigzag`` (head-tail, the default): rank ``i`` holds chunks ``i`` and ``2*cp - 1 - i``. Under a
  causal mask a chunk's attention work grows with its index, so pairing an early chunk with a late
  one gives every rank the same work (``cp = 2``: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2);
* ``contiguous``: rank ``i`` holds chunks ``2i`` and ``2i + 1``, one contiguous piece; the last rank
  does about ``2 * cp - 1`` times the work of the first. Kept as the reference layout and for tests.

* an explicit ``assignment`` (the chunk pair of every rank), which
  :func:`plait.context_parallel.balance.balanced_split` chooses for packed rows by attention work.

All layouts use the same two-chunk shape, so the ring code handles them alike; only the chunk
numbers differ. Everything here is pure index arithmetic with no communication, so the split of a
batch, its inverse and the ring's causal masks can be tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: chunks each rank holds
CHUNKS_PER_RANK = 2


@dataclass(frozen=True)
class SequenceSplit:
    """The cut of a ``seq_len``-token sequence over ``cp`` ranks (see the module docstring)."""

    seq_len: int
    cp: int
    zigzag: bool = True
    #: the chunks of each rank (overrides ``zigzag``): ``cp`` pairs covering ``0 .. 2cp-1`` once
    assignment: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ValueError(f"cp={self.cp} must be a positive integer")
        if self.seq_len % (CHUNKS_PER_RANK * self.cp):
            raise ValueError(f"seq_len={self.seq_len} is not divisible by 2*cp={2 * self.cp}; each of the cp "
                             f"ranks holds two equal chunks of the sequence")
        if self.assignment is not None and (
                len(self.assignment) != self.cp or any(len(pair) != CHUNKS_PER_RANK for pair in self.assignment)
                or sorted(c for pair in self.assignment for c in pair) != list(range(CHUNKS_PER_RANK * self.cp))):
            raise ValueError(f"assignment={self.assignment} must give each of the {self.cp} ranks two chunks, "
                             f"every chunk of 0..{2 * self.cp - 1} once")

    @property
    def chunk_len(self) -> int:
        """Tokens of one chunk (``seq_len / (2 * cp)``)."""
        return self.seq_len // (CHUNKS_PER_RANK * self.cp)

    @property
    def local_len(self) -> int:
        """Tokens each rank holds (``seq_len / cp``)."""
        return CHUNKS_PER_RANK * self.chunk_len

    def chunks(self, rank: int) -> tuple[int, int]:
        """The global chunk numbers ``rank`` holds, in local order."""
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank={rank} is outside [0, cp={self.cp})")
        if self.assignment is not None:
            return self.assignment[rank]
        if self.zigzag:
            return rank, 2 * self.cp - 1 - rank
        return 2 * rank, 2 * rank + 1

    def chunk_indices(self, chunk: int, device: torch.device | None = None) -> torch.Tensor:
        """Global token indices of ``chunk``."""
        n = self.chunk_len
        return torch.arange(chunk * n, (chunk + 1) * n, device=device)

    def indices(self, rank: int, device: torch.device | None = None) -> torch.Tensor:
        """Global token indices of ``rank``'s local sequence (``[local_len]``, in local order)."""
        return torch.cat([self.chunk_indices(c, device) for c in self.chunks(rank)])

    def split(self, x: torch.Tensor, rank: int, dim: int = -1) -> torch.Tensor:
        """``rank``'s local part of ``x`` (the full sequence along ``dim``), contiguous."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"dimension {dim} of x has {x.shape[dim]} positions, expected seq_len={self.seq_len}")
        parts = x.chunk(CHUNKS_PER_RANK * self.cp, dim=dim)
        return torch.cat([parts[c] for c in self.chunks(rank)], dim=dim).contiguous()

    def unsplit(self, parts: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
        """The full sequence from every rank's local part (``parts[r]`` from rank ``r``)."""
        if len(parts) != self.cp:
            raise ValueError(f"got {len(parts)} local parts, expected cp={self.cp}")
        chunks: list[torch.Tensor | None] = [None] * (CHUNKS_PER_RANK * self.cp)
        for rank, part in enumerate(parts):
            for c, piece in zip(self.chunks(rank), part.chunk(CHUNKS_PER_RANK, dim=dim), strict=True):
                chunks[c] = piece
        assert all(c is not None for c in chunks), "the chunks of all ranks cover the sequence"
        return torch.cat([c for c in chunks if c is not None], dim=dim)
