"""Attention work per cp rank: what the zigzag split balances, measured.

Under a causal (or, for packed rows, document-causal) mask a query at index ``i`` of its document
attends to ``i + 1`` keys, so a rank's attention FLOPs are proportional to the sum of ``i + 1``
over its tokens. With one document per row the zigzag split (chunk ``r`` with chunk
``2*cp - 1 - r``) gives every rank exactly the same work (:func:`plait.context_parallel.plan.causal_work`).
With packed rows the work of a chunk depends on where documents start inside it, so the split is
balanced by token count and only approximately by work; :func:`attention_work` gives the exact
numbers and :func:`imbalance` the ratio reported in docs/context_parallel.md.
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


def imbalance(work: list[int]) -> float:
    """``max / mean`` of the per-rank work (1.0: perfectly balanced)."""
    return max(work) / (sum(work) / len(work))
