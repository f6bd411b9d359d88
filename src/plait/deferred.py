"""Parameters whose values are produced only where a rank keeps them (ZeRO-3's shard-only build).

A normal build allocates a rank's whole local model (its TP shard of its pipeline stages) and
fills it. Under ZeRO-3 a rank keeps only ``1/dp`` of that, so the builder can instead give every
parameter a *placeholder* (the right shape, device and dtype, no memory: one element expanded)
and record here where its values come from: the layout-invariant initialisation of
:mod:`plait.init` or a Hugging Face directory (:class:`~plait.models.hf_io.HFRowReader`). The
optimizer then asks, bucket by bucket, for the flat ranges it owns (:meth:`DeferredValues.flat_range`)
and writes them straight into its owned chunks; a range is computed from the rows that hold it and
nothing else, so the transient memory of the build is one row window, never a whole parameter.

The values are bitwise those of the normal build: :func:`plait.init.initial_rows` draws the same
blocks, and the reader reads the same checkpoint entries. A placeholder reads as zeros; every
trainable one is replaced by the optimizer (which refuses to start while any placeholder is left,
see :meth:`DeferredValues.left_in`), and frozen ones are filled whole at build time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from plait.init import fill_rows_, initial_constants, initial_rows
from plait.models.hf_io import HFRowReader, HFTensors
from plait.parallel_state import shard_specs
from plait.tensor_parallel.sharding import ShardSpec


@dataclass(frozen=True)
class _Origin:
    name: str  #: the parameter's name in its stage (the name the initialisation and the checkpoint use)
    spec: ShardSpec | None
    shape: tuple[int, ...]  #: the local shape
    constant: float | None = None  #: the constant its module starts it at (:func:`plait.init.initial_constants`)


class DeferredValues:
    """Where each placeholder parameter's values come from (see the module doc)."""

    def __init__(self, *, seed: int, std: float, tensors: HFTensors | None, device: torch.device) -> None:
        self.seed, self.std, self.device = seed, std, device
        self._reader = HFRowReader(tensors) if tensors is not None else None
        self._origins: dict[int, _Origin] = {}
        self._depth = 0  #: nesting of ``with`` blocks: the files stay open until the outermost ends

    # ------------------------------------------------------------------ building
    def place(self, module: nn.Module) -> None:
        """Give every parameter of ``module`` (one stage, on the meta device) a placeholder on the
        device, allocate its buffers, and record each parameter's origin. Tied parameters stay tied
        (one placeholder per parameter object); frozen parameters are filled whole at once."""
        specs = shard_specs(module)
        names = {id(p): n for n, p in module.named_parameters()}
        constants = initial_constants(module)
        placed: dict[int, nn.Parameter] = {}
        for sub in module.modules():
            for key, p in list(sub._parameters.items()):
                if p is None:
                    continue
                if id(p) not in placed:
                    hold = torch.zeros((), dtype=p.dtype, device=self.device).expand(p.shape)
                    placed[id(p)] = nn.Parameter(hold, requires_grad=p.requires_grad)
                    name = names[id(p)]
                    origin = _Origin(name, specs.get(name), tuple(p.shape), constants.get(name))
                    self._origins[id(placed[id(p)])] = origin
                sub._parameters[key] = placed[id(p)]
            for key, b in list(sub._buffers.items()):
                if b is not None and b.device.type == "meta":
                    sub._buffers[key] = torch.empty_like(b, device=self.device)
        with self:
            for p in placed.values():
                if not p.requires_grad or p.dim() == 0:  # the optimizer fills only what it trains
                    p.data = self.flat_range(p, 0, p.numel()).view(p.shape).to(p.dtype)

    # ------------------------------------------------------------------ reading
    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of this build's placeholders."""
        return id(param) in self._origins

    def __enter__(self) -> DeferredValues:
        """Keep the checkpoint files open while ranges are read (re-entrant)."""
        if self._reader is not None and self._depth == 0:
            self._reader.__enter__()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._reader is not None and self._depth == 0:
            self._reader.__exit__(*exc)

    def write_flat_(self, param: torch.Tensor, start: int, dest: torch.Tensor) -> None:
        """Write elements ``[start, start + len(dest))`` of ``param``'s flattened local value into the
        1-D ``dest``: its whole rows straight into ``dest`` when it is fp32 on the CPU (no
        temporary), the partial rows at either end through :meth:`flat_range`."""
        origin = self._origins[id(param)]
        row = math.prod(origin.shape[1:]) if len(origin.shape) > 1 else 1
        end = start + dest.numel()
        first, last = -(-start // row), end // row  # the rows wholly inside the range
        if first >= last or dest.dtype != torch.float32 or dest.device.type != "cpu" or not dest.is_contiguous():
            dest.copy_(self.flat_range(param, start, end))
            return
        head, body = first * row - start, (last - first) * row
        if head:
            dest[:head].copy_(self.flat_range(param, start, first * row))
        rows = dest[head:head + body].view((last - first,) + origin.shape[1:])
        if self._reader is not None:
            self._reader.read_rows_(rows, origin.name, origin.spec, first)
        else:
            fill_rows_(rows, origin.name, origin.spec, origin.shape, self.seed, self.std, first, origin.constant)
        if head + body < dest.numel():
            dest[head + body:].copy_(self.flat_range(param, last * row, end))

    def flat_range(self, param: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of ``param``'s flattened local value (fp32, on the device),
        computed from the rows that hold them only."""
        origin = self._origins[id(param)]
        row = math.prod(origin.shape[1:]) if len(origin.shape) > 1 else 1
        first, last = start // row, -(-end // row)
        if self._reader is not None:
            rows = self._reader.rows(origin.name, origin.spec, origin.shape, first, last)
        else:
            rows = initial_rows(origin.name, origin.spec, origin.shape, self.seed, self.std, first, last,
                                origin.constant)
        return rows.reshape(-1)[start - first * row:end - first * row].to(self.device)

    def left_in(self, modules: list[nn.Module]) -> list[str]:
        """The parameters of ``modules`` still holding placeholders (none once the optimizer adopted them)."""
        out = []
        for module in modules:
            for name, p in module.named_parameters():
                if self.holds(p) and is_placeholder(p):
                    out.append(name)
        return out


def is_placeholder(param: torch.Tensor) -> bool:
    """Whether ``param`` still holds a placeholder: one element expanded to its shape."""
    return param.dim() > 0 and param.numel() > 0 and all(s == 0 for s in param.stride())
