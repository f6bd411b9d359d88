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


# ------------------------------------------------------------------------------ memory terms
#: fp32 score-sized tensors alive at once in :func:`plait.context_parallel.blocks.piece_backward`:
#: the scores ``s``, the probabilities ``p``, ``dp = dout @ v^T``, ``dp - delta`` and
#: ``ds = p * (dp - delta)`` (``s`` stays referenced until the piece returns). The forward of a
#: piece holds at most three (scores, ``s - lse``, ``exp``), so the backward is the peak.
BACKWARD_SCORE_TENSORS = 5


def piece_scores_bytes(micro_batch_size: int, local_seq: int, q_heads: int) -> int:
    """Bytes of one piece's fp32 scores ``[batch, kv_heads, group, n, n]`` (``n = local_seq / 2``,
    the chunk length; ``q_heads = kv_heads * group``, the rank's local query heads)."""
    n = local_seq // 2
    return 4 * micro_batch_size * q_heads * n * n


def attention_workspace_bytes(micro_batch_size: int, local_seq: int, q_heads: int) -> int:
    """The transient peak of the CPU math kernel while it computes one piece's backward (ring and
    all-gather alike): :data:`BACKWARD_SCORE_TENSORS` fp32 score tensors and the diagonal piece's
    boolean causal mask (``n * n`` bytes). Quadratic in the chunk length, so it falls as
    ``1 / cp^2``; a flash kernel returning the LSE would keep only ``O(n)`` of it. Not saved for
    backward: it exists during one piece at a time, in the attention backward of each layer."""
    n = local_seq // 2
    return BACKWARD_SCORE_TENSORS * piece_scores_bytes(micro_batch_size, local_seq, q_heads) + n * n


def ring_buffer_bytes(micro_batch_size: int, local_seq: int, kv_width: int) -> int:
    """The ring's blocks in flight during one layer's attention backward, fp32: the K/V block at hand
    and the one arriving, the dK/dV accumulator arriving, the one leaving and the block's own
    (``5 * 2 * B * (S / cp) * k * 4``, ``k = kv_heads * head_dim`` of the rank)."""
    return 5 * 2 * micro_batch_size * local_seq * kv_width * 4
