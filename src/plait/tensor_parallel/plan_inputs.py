"""What every family's tensor-parallel plan checks and reads before it swaps in parallel layers:
the MLP width against ``tp``, the dropout generator against this rank, and the full weights the
shards are cut from (none on the meta device). One place, so the plans cannot drift apart."""

from __future__ import annotations

import torch
from torch import nn

from plait.mesh import ParallelMesh
from plait.tensor_parallel.random import TensorParallelRNG


def check_mlp_split(intermediate_size: int, tp: int) -> None:
    """Refuse an MLP width that ``tp`` ranks cannot share evenly."""
    if intermediate_size % tp:
        raise ValueError(f"intermediate_size={intermediate_size} is not divisible by tp={tp}; "
                         f"choose a tp that divides it")


def rng_for(rng: TensorParallelRNG | None, mesh: ParallelMesh) -> TensorParallelRNG:
    """The plan's dropout generator: ``rng`` when it was seeded for this TP rank, a seed-0 one when none."""
    if rng is None:
        return TensorParallelRNG(0, mesh.tp_rank)
    if rng.tp_rank != mesh.tp_rank:
        raise ValueError(f"rng={rng!r} was seeded for tp_rank={rng.tp_rank} but this rank's TP rank is "
                         f"{mesh.tp_rank}; build it as TensorParallelRNG(seed, mesh.tp_rank)")
    return rng


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full tensors to cut shards from; empty when it is on the meta device (nothing to cut)."""
    if next(model.parameters()).device.type == "meta":
        return {}
    return {k: v.detach() for k, v in model.state_dict().items()}


__all__ = ["check_mlp_split", "full_weights", "rng_for"]
