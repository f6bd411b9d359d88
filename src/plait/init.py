"""Layout-invariant initialisation: a parameter's initial value depends only on (seed, name).

Each parameter's *full* tensor is drawn from a generator seeded by a hash of the run seed and
the parameter's fully qualified name, then this rank's shard is cut from it with the
parameter's :class:`ShardSpec`. Every TP/PP/DP layout therefore starts from bitwise the same
weights as one process. The cost is one full parameter of transient host memory at a time.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from plait.parallel_state import shard_specs


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed derived from the run seed and a parameter name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """The full fp32 initial tensor of parameter ``name`` (on the CPU).

    Norm weights start at one, biases at zero, every other weight ~ N(0, std^2) (Llama's rule).
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float) -> None:
    """Fill every parameter of ``model`` (already allocated) with its layout-invariant value."""
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        spec = specs.get(name)
        full = initial_value(name, spec.full_shape if spec else tuple(p.shape), seed, std)
        p.copy_(spec.shard(full) if spec else full)
