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
def fill_initial_(out: torch.Tensor, name: str, spec: ShardSpec | None, seed: int, std: float,
                  constant: float | None = None) -> None:
    """Write parameter ``name``'s initial local value into ``out`` in place, block by block
    (``constant``: the value its module gives it, see :func:`initial_constants`)."""
    fill_rows_(out, name, spec, tuple(out.shape), seed, std, 0, constant)


def initial_rows(name: str, spec: ShardSpec | None, local_shape: tuple[int, ...], seed: int, std: float,
                 first: int, end: int, constant: float | None = None) -> torch.Tensor:
    """Rows ``[first, end)`` (along dim 0) of parameter ``name``'s initial local value, bitwise equal
    to the same rows of :func:`initial_shard`, computed without the other rows: a rank that keeps
    only a range of a parameter (ZeRO-3) never holds the rest of it."""
    if not 0 <= first <= end <= local_shape[0]:
        raise ValueError(f"{name}: rows [{first}, {end}) are outside its {local_shape[0]} local rows")
    out = torch.empty((end - first,) + tuple(local_shape[1:]))
    fill_rows_(out, name, spec, tuple(local_shape), seed, std, first, constant)
    return out


@torch.no_grad()
def fill_rows_(out: torch.Tensor, name: str, spec: ShardSpec | None, local_shape: tuple[int, ...], seed: int,
               std: float, first: int, constant: float | None = None) -> None:
    """Write local rows ``[first, first + len(out))`` of ``name``'s initial value into ``out``
    (a replicated weight's whole blocks are drawn straight into a contiguous fp32 ``out``).
    ``constant``: the parameter starts at that value everywhere (a norm's weight: see
    :func:`initial_constants`); otherwise a name ending in ``norm.weight`` starts at one."""
    end = first + out.shape[0]
    full_shape = spec.full_shape if spec is not None else local_shape
    if constant is not None:
        out.copy_(_masked(torch.full(local_shape, float(constant)), spec)[first:end])
        return
    if name.endswith("norm.weight"):
        out.copy_(_masked(torch.ones(local_shape), spec)[first:end])
        return
    if name.endswith(".bias"):
        out.zero_()
        return
    rpb = _rows_per_block(full_shape)
    if spec is None or spec.dim == 1:  # local rows are full rows
        for b in range(first // rpb, -(-end // rpb)):
            lo, hi = max(first, b * rpb), min(end, (b + 1) * rpb)
            if lo >= hi:
                continue
            whole = lo == b * rpb and hi == min(full_shape[0], (b + 1) * rpb)
            if spec is None and whole and out.dtype == torch.float32 and out.is_contiguous():
                gen = torch.Generator().manual_seed(name_seed(seed, f"{name}#{b}"))
                out[lo - first:hi - first].normal_(0.0, std, generator=gen)  # no temporary block
                continue
            block = _block(name, full_shape, b, seed, std)[lo - b * rpb:hi - b * rpb]
            if spec is None:
                out[lo - first:hi - first].copy_(block)
                continue
            index = torch.tensor(spec.index, dtype=torch.long)
            real = (index >= 0).nonzero().flatten()
            rows = out[lo - first:hi - first]
            rows.zero_()  # padding columns stay zero
            rows.index_copy_(1, real.to(out.device), block.index_select(1, index[real]).to(out.device, out.dtype))
        return
    assert spec.dim == 0, "weights are sharded along rows (column-parallel) or columns (row-parallel)"
    out.zero_()  # padding entries stay zero
    index = torch.tensor(spec.index[first:end], dtype=torch.long)
    for b in sorted({i // rpb for i in spec.index[first:end] if i >= 0}):
        block = _block(name, full_shape, b, seed, std)
        local = ((index >= b * rpb) & (index < (b + 1) * rpb)).nonzero().flatten()
        out[local] = block[index[local] - b * rpb].to(out.dtype)


def _masked(t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    if spec is None:
        return t
    valid = torch.tensor([i >= 0 for i in spec.index], dtype=t.dtype)
    shape = [1] * t.dim()
    shape[spec.dim] = -1
    return t * valid.view(shape)


@torch.no_grad()
def initial_constants(model: nn.Module) -> dict[str, float]:
    """``{parameter name: value}`` of the weights that start at a constant their module names
    (``initial_constant``: a norm's 1, or the 0 of an offset norm whose weight multiplies as
    ``1 + weight``); the names are ``model``'s."""
    out = {}
    for prefix, module in model.named_modules():
        value = getattr(module, "initial_constant", None)
        if isinstance(value, (int, float)) and module._parameters.get("weight") is not None:
            out[f"{prefix}.weight" if prefix else "weight"] = float(value)
    return out


def init_parameters(model: nn.Module, seed: int, std: float) -> None:
    """Fill every parameter of ``model`` (already allocated) with its layout-invariant value."""
    specs = shard_specs(model)
    constants = initial_constants(model)
    for name, p in model.named_parameters():
        fill_initial_(p.data, name, specs.get(name), seed, std, constants.get(name))
