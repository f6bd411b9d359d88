"""Layout-invariant initialisation: a parameter's initial value depends only on (seed, name).

A weight's full tensor is defined block by block: its rows are grouped into fixed blocks of about
4M elements, and block ``b`` is drawn from a generator seeded by a hash of the run seed, the
parameter's fully qualified name and ``b``. A rank builds its shard directly from the blocks it
needs (row-sharded weights skip the other blocks entirely; column-sharded ones draw each block
and keep their columns), so

* every TP/PP/DP layout starts from bitwise the same weights as one process, and
* transient memory while initialising is one block (16 MB in fp32), never a full parameter.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from plait.parallel_state import shard_specs
from plait.tensor_parallel.sharding import ShardSpec

BLOCK_ELEMENTS = 1 << 22


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed derived from the run seed and a name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _rows_per_block(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def _block(name: str, shape: tuple[int, ...], b: int, seed: int, std: float) -> torch.Tensor:
    rpb = _rows_per_block(shape)
    rows = min(rpb, shape[0] - b * rpb)
    gen = torch.Generator().manual_seed(name_seed(seed, f"{name}#{b}"))
    return torch.empty((rows,) + tuple(shape[1:])).normal_(0.0, std, generator=gen)


def initial_shard(name: str, spec: ShardSpec | None, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """This rank's part of parameter ``name``'s initial value (``shape`` is the full shape when
    ``spec`` is None, else ignored in favour of ``spec.full_shape``)."""
    local_shape = spec.local_shape if spec is not None else tuple(shape)
    out = torch.empty(local_shape)
    fill_initial_(out, name, spec, seed, std)
    return out


@torch.no_grad()
def fill_initial_(out: torch.Tensor, name: str, spec: ShardSpec | None, seed: int, std: float) -> None:
    """Write parameter ``name``'s initial local value into ``out`` in place, block by block."""
    full_shape = spec.full_shape if spec is not None else tuple(out.shape)
    if name.endswith("norm.weight"):
        out.copy_(_masked(torch.ones(out.shape), spec))
        return
    if name.endswith(".bias"):
        out.zero_()
        return
    rpb = _rows_per_block(full_shape)
    nblocks = -(-full_shape[0] // rpb)
    if spec is None:
        for b in range(nblocks):
            out[b * rpb:(b + 1) * rpb].copy_(_block(name, full_shape, b, seed, std))
        return
    out.zero_()  # padding entries stay zero
    index = torch.tensor(spec.index, dtype=torch.long)
    if spec.dim == 0:
        for b in sorted({i // rpb for i in spec.index if i >= 0}):
            block = _block(name, full_shape, b, seed, std)
            local = ((index >= b * rpb) & (index < (b + 1) * rpb)).nonzero().flatten()
            out[local] = block[index[local] - b * rpb].to(out.dtype)
        return
    assert spec.dim == 1, "weights are sharded along rows (column-parallel) or columns (row-parallel)"
    real = (index >= 0).nonzero().flatten().to(out.device)
    for b in range(nblocks):
        block = _block(name, full_shape, b, seed, std)
        picked = block.index_select(1, index[real.cpu()]).to(out.device, out.dtype)
        out[b * rpb:(b + 1) * rpb].index_copy_(1, real, picked)


def _masked(t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    if spec is None:
        return t
    valid = torch.tensor([i >= 0 for i in spec.index], dtype=t.dtype)
    shape = [1] * t.dim()
    shape[spec.dim] = -1
    return t * valid.view(shape)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float) -> None:
    """Fill every parameter of ``model`` (already allocated) with its layout-invariant value."""
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        fill_initial_(p.data, name, specs.get(name), seed, std)
