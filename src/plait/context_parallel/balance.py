"""Attention work per cp rank: what the zigzag split balances, measured.

Under a causal (or, for packed rows, document-causal) mask a query at index ``i`` of its document
attends to ``i + 1`` keys, so a rank's attention FLOPs are proportional to the sum of ``i + 1``
over its tokens. With one document per row the zigzag split (chunk ``r`` with chunk
``2*cp - 1 - r``) gives every rank exactly the same work (:func:`plait.context_parallel.plan.causal_work`).
With packed rows the work of a chunk depends on where documents start inside it; zigzag is then
balanced by token count and only approximately by work. :func:`balanced_split` pairs the chunks by
their measured work instead (heaviest with lightest, which minimises the largest pair's work over
all pairings, and gives zigzag back for one document per row). :func:`attention_work` gives the
exact numbers and :func:`imbalance` the ratio reported in docs/context_parallel.md.
"""

from __future__ import annotations

import torch

from plait.context_parallel.split import SequenceSplit


def keys_seen(segment_ids: torch.Tensor) -> torch.Tensor:
    """For ``segment_ids [..., seq]`` (documents contiguous), the number of keys each token attends to."""
    s = segment_ids.shape[-1]
    idx = torch.arange(s, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - first + 1


def attention_work(segment_ids: torch.Tensor, split: SequenceSplit) -> list[int]:
    """Query-key pairs each cp rank computes for ``segment_ids [..., seq]`` (summed over rows)."""
    seen = keys_seen(segment_ids)
    return [int(split.split(seen, r).sum()) for r in range(split.cp)]


def chunk_work(segment_ids: torch.Tensor, cp: int) -> list[int]:
    """Query-key pairs of each of the ``2 * cp`` chunks of ``segment_ids [..., seq]`` (summed over rows)."""
    seen = keys_seen(segment_ids)
    return [int(c.sum()) for c in seen.chunk(2 * cp, dim=-1)]


def balanced_split(segment_ids: torch.Tensor, cp: int) -> SequenceSplit:
    """The split of ``segment_ids [rows, seq]`` (one micro-batch) whose chunk pairs balance the
    attention work: chunks sorted by work, the heaviest paired with the lightest; rank ``r`` gets the
    pair with the ``r``-th smallest first chunk."""
    seq = segment_ids.shape[-1]
    work = chunk_work(segment_ids, cp)
    order = sorted(range(2 * cp), key=lambda c: (work[c], c))
    pairs = sorted(tuple(sorted((order[i], order[2 * cp - 1 - i]))) for i in range(cp))
    return SequenceSplit(seq, cp, assignment=tuple((a, b) for a, b in pairs))


def imbalance(work: list[int]) -> float:
    """``max / mean`` of the per-rank work (1.0: perfectly balanced)."""
    return max(work) / (sum(work) / len(work))
