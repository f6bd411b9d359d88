"""Which decoder layers each pipeline stage holds, for the trainer and ``plait config show``.

The model of the config's family is traced (its blocks as leaves), each unit (embedding, blocks,
final norm, head) gets a cost, and the units are cut into ``pp * vpp`` contiguous stages:
cost-balanced by default, NxD's even split by layer count, or at named cut points. It lives above
both :mod:`plait.pipeline` (the model-agnostic tracer and partitioner) and :mod:`plait.models`
(the family that builds the model to trace).
"""

from __future__ import annotations

from typing import Any

import torch

from plait.models.registry import family_of
from plait.pipeline.partition import partition_model, unit_costs
from plait.pipeline.trace import trace_units


def plan_partition(config: Any, num_stages: int, seq_len: int, *, method: str = "balanced",
                   cost: str = "flops", cuts: list[str] | None = None):
    """The :class:`~plait.pipeline.partition.Partition` of ``config``'s model into ``num_stages``."""
    with torch.device("meta"):
        model = family_of(config).causal_lm_cls(config)
    units = trace_units(model)
    costs = unit_costs(config, units, seq_len, kind=cost)
    return partition_model(units, costs, num_stages, method=method, cuts=cuts, cost_kind=cost)


def partition_for(resolved, vocab_size: int | None = None):
    """The partition a resolved recipe asks for (``None`` without pipeline parallelism)."""
    p = resolved.recipe.parallel
    if p.pp == 1:
        return None
    config = resolved.model_config(vocab_size)
    return plan_partition(config, p.pp * p.vpp, resolved.recipe.data.seq_len, method=p.partition,
                          cost=p.partition_cost, cuts=p.pipeline_cuts)
