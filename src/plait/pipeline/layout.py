"""Which decoder layers each pipeline stage holds, for the trainer and ``plait config show``.

The model is traced (transformer blocks as leaves), each unit (embedding, blocks, final norm,
head) gets a cost, and the units are cut into ``pp * vpp`` contiguous stages: cost-balanced by
default, NxD's even split by layer count, or at named cut points.
"""

from __future__ import annotations

import torch

from plait.models.llama.config import LlamaConfig


def plan_partition(config: LlamaConfig, num_stages: int, seq_len: int, *, method: str = "balanced",
                   cost: str = "flops", cuts: list[str] | None = None):
    """The :class:`~plait.pipeline.partition.Partition` of a Llama model into ``num_stages``."""
    from plait.models.llama.model import LlamaForCausalLM
    from plait.pipeline.partition import partition_model, unit_costs
    from plait.pipeline.trace import trace_units

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    units = trace_units(model)
    costs = unit_costs(config, units, seq_len, kind=cost)
    return partition_model(units, costs, num_stages, method=method, cuts=cuts, cost_kind=cost)


def stage_layer_lists(config: LlamaConfig, num_stages: int, seq_len: int, **kw) -> list[list[int]]:
    """Decoder-layer indices of each global stage, in order."""
    partition = plan_partition(config, num_stages, seq_len, **kw)
    prefix = "model.layers."
    return [[int(name[len(prefix):]) for name in stage if name.startswith(prefix)] for stage in partition.stages]


def partition_for(resolved, vocab_size: int | None = None):
    """The partition a resolved recipe asks for (``None`` without pipeline parallelism)."""
    p = resolved.recipe.parallel
    if p.pp == 1:
        return None
    config = resolved.llama_config(vocab_size)
    return plan_partition(config, p.pp * p.vpp, resolved.recipe.data.seq_len, method=p.partition,
                          cost=p.partition_cost, cuts=p.pipeline_cuts)
