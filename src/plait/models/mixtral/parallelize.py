"""The tensor-parallel plan of the MoE families (Mixtral, Qwen3-MoE): not available yet.

Experts are not sharded over a tensor-parallel group, and the router of a sequence-parallel
shard would need its weight gradients summed over the group; until that plan exists a
tensor-parallel degree above one is refused here (and by the recipe checks, before launch,
naming ``parallel.tp``). The builder only calls a family's plan when ``tp > 1``.
"""

from __future__ import annotations

from torch import nn

from plait.mesh import ParallelMesh
from plait.tensor_parallel import TensorParallelRNG


def parallelize(model: nn.Module, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                rng: TensorParallelRNG | None = None) -> nn.Module:
    """The model unchanged at ``tp == 1``; a ValueError naming the fix otherwise."""
    del sequence_parallel, rng  # the plan's signature; nothing to apply at tp == 1
    if mesh.tp > 1:
        family = type(model).__name__
        raise ValueError(f"parallel.tp={mesh.tp}: tensor parallelism is not available for Mixture-of-Experts "
                         f"models ({family}) yet; set parallel.tp=1")
    return model
