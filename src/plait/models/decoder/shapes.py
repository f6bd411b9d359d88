"""The per-rank widths a family's tensor-parallel plan gives one decoder layer and the vocabulary.

A family's ``local_shapes`` (:class:`~plait.models.family.ModelFamily`) computes them from the
config alone, as its ``parallelize`` builds them, so that the planner (:mod:`plait.plan`) prices
the shards a run will hold without building a model; ``tests/test_family_shapes.py`` checks them
against the parameters of every family's parallelized model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalShapes:
    """Per-TP-rank widths of one decoder layer and the vocabulary (``tp = 1``: the full model's)."""

    tp: int
    hidden: int
    q: int            # local query width, padding heads included
    kv: int           # local K (= V) width, replicated KV heads included
    q_heads: int      # local query heads
    intermediate: int  # local width of a dense MLP
    vocab: int        # local vocabulary rows (padded)
    head_padding: bool
    vocab_padding: bool
    ep: int = 1       # expert parallelism: each sparse layer holds experts / ep whole experts (set by the planner)


__all__ = ["LocalShapes"]
