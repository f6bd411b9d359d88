"""The ring schedule as data: which K/V block a rank holds at each step and which query/key chunk
pairs it computes there.

At step ``t`` of a ring running in ``direction`` (+1: blocks travel to the next rank), rank ``r``
holds the K/V block of rank ``r - direction * t`` and sends it on while computing with it. The
local queries (two chunks) meet the block's keys (two chunks) in four *pieces*; a causal mask leaves
a piece

* ``full`` when the key chunk comes before the query chunk (every query sees every key),
* ``diagonal`` when it is the same chunk (a lower-triangular mask),
* skipped when the key chunk comes after the query chunk (no query sees any key).

The executor (:mod:`plait.context_parallel.ring`) only carries out this plan; tests read it as a list
and count each rank's attention work from it (:func:`causal_work`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plait.context_parallel.split import SequenceSplit

PieceKind = Literal["full", "diagonal"]


@dataclass(frozen=True)
class Piece:
    """Local query chunk ``q_slot`` (0 or 1) against key chunk ``k_slot`` of the block at hand."""

    q_slot: int
    k_slot: int
    q_chunk: int
    k_chunk: int
    kind: PieceKind


@dataclass(frozen=True)
class RingStep:
    step: int
    #: the rank whose K/V block is computed with at this step
    owner: int
    pieces: tuple[Piece, ...]


def pieces(split: SequenceSplit, rank: int, owner: int) -> tuple[Piece, ...]:
    """The pieces of ``rank``'s queries against ``owner``'s keys that a causal mask leaves."""
    out = []
    for qs, qc in enumerate(split.chunks(rank)):
        for ks, kc in enumerate(split.chunks(owner)):
            if kc < qc:
                out.append(Piece(qs, ks, qc, kc, "full"))
            elif kc == qc:
                out.append(Piece(qs, ks, qc, kc, "diagonal"))
    return tuple(out)


def ring_plan(split: SequenceSplit, rank: int, direction: int = 1) -> list[RingStep]:
    """Rank ``rank``'s ``cp`` ring steps; ``direction`` +1 (forward pass) or -1 (backward pass)."""
    if direction not in (1, -1):
        raise ValueError(f"direction={direction} must be +1 or -1")
    steps = []
    for t in range(split.cp):
        owner = (rank - direction * t) % split.cp
        steps.append(RingStep(t, owner, pieces(split, rank, owner)))
    return steps


def causal_work(split: SequenceSplit, rank: int) -> int:
    """Query-key pairs ``rank`` computes under a causal mask (proportional to its attention FLOPs)."""
    n = split.chunk_len
    pairs = {"full": n * n, "diagonal": n * (n + 1) // 2}
    return sum(pairs[p.kind] for step in ring_plan(split, rank) for p in step.pieces)
