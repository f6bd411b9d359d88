"""The routed experts: one gated MLP per expert, computed over dispatch-sorted tokens.

Each expert is its own module under its global index (``experts.5.gate_proj.weight``), the way
Hugging Face checkpoints name them, so parameter names never change with the layout: with expert
parallelism a rank simply holds fewer entries of the same :class:`Experts` dictionary. A family
picks its projection names by subclassing :class:`ExpertMLP` (Mixtral: ``w1``/``w3``/``w2``).

Computation (:meth:`Experts.forward`) takes rows already sorted by expert. With a usable
grouped matmul (:mod:`plait.nn.moe.grouped`) the experts' weights are stacked in ``nn.Linear``'s
layout (one copy of the local expert weights per forward): gate and up interleaved per expert as
``[E, 2I, H]`` (one grouped call for both, as transformers' fused ``gate_up_proj``), down as
``[E, H, I]``; two grouped calls forward and four backward, no host read, and each expert's
weight gradient is a contiguous slice of the stacked gradient (no further copy). Otherwise a loop
over experts slices the rows, which reads the run ends on the host once per layer.

Why grouped on the CPU as well: ``torch._grouped_mm`` there runs one ``mm`` per group inside one
call, as fast as a Python loop over experts at one thread (measured, docs/BENCHMARKS.md) and
with fewer operations and no host read; the loop stays for devices and dtypes the grouped call
does not support (:func:`~plait.nn.moe.grouped.grouped_mm_usable`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from plait.nn.moe.grouped import grouped_linear, grouped_mm_usable


class ExpertMLP(nn.Module):
    """One SwiGLU expert ``down(silu(gate(x)) * up(x))`` without biases; ``names`` are the
    attribute names of (gate, up, down)."""

    names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        gate, up, down = self.names
        setattr(self, gate, nn.Linear(hidden_size, intermediate_size, bias=False, **kw))
        setattr(self, up, nn.Linear(hidden_size, intermediate_size, bias=False, **kw))
        setattr(self, down, nn.Linear(intermediate_size, hidden_size, bias=False, **kw))

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        gate, up, down = (getattr(self, n) for n in self.names)
        return gate, up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.projections()
        return down(F.silu(gate(x)) * up(x))


class Experts(nn.ModuleDict):
    """The experts this module holds, keyed by global index (``"0"`` .. ``"E-1"``).

    ``num_experts`` is the global count; :attr:`local_ids` the held indices in order (all of them
    unless expert parallelism removed some; they are always a contiguous range).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 expert_cls: type[ExpertMLP] = ExpertMLP, device=None, dtype=None) -> None:
        super().__init__({str(e): expert_cls(hidden_size, intermediate_size, device=device, dtype=dtype)
                          for e in range(num_experts)})
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size

    @property
    def local_ids(self) -> list[int]:
        return sorted(int(k) for k in self.keys())

    def keep_only(self, ids: range) -> None:
        """Drop every expert outside ``ids`` (expert parallelism: this rank's share)."""
        for key in list(self.keys()):
            if int(key) not in ids:
                del self[key]

    def forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, H]`` sorted by local expert, ``ends`` ``[E_local]`` int32 run ends ->
        ``[N, H]``; rows past ``ends[-1]`` are undefined."""
        experts = [self[str(e)] for e in self.local_ids]
        assert isinstance(experts[0], ExpertMLP)
        if device_type_autocast(x) is not None:
            x = x.to(device_type_autocast(x))
        if grouped_mm_usable(x, self.hidden_size, self.intermediate_size):
            return _grouped(x, ends, experts)
        return _looped(x, ends, experts)


def device_type_autocast(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype in force for ``x``'s device, or ``None``."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _stack(weights: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``[len(weights), out, in]``: the weights stacked in their own (``nn.Linear``) layout."""
    return torch.stack(weights).to(dtype)


def _grouped(x: torch.Tensor, ends: torch.Tensor, experts: list) -> torch.Tensor:
    projections = [e.projections() for e in experts]
    inter = projections[0][0].weight.shape[0]
    # [gate_0; up_0; gate_1; up_1; ...] -> [E, 2I, H]: gate and up of one expert in one grouped call
    gate_up = _stack([p.weight for g, u, _ in projections for p in (g, u)], x.dtype).view(len(experts), 2 * inter, -1)
    gate, up = grouped_linear(x, gate_up, ends).split(inter, dim=-1)
    return grouped_linear(F.silu(gate) * up, _stack([d.weight for _, _, d in projections], x.dtype), ends)


def _looped(x: torch.Tensor, ends: torch.Tensor, experts: list) -> torch.Tensor:
    bounds = [0] + ends.tolist()  # the one host read of this path
    pieces = [expert(x[lo:hi]).to(x.dtype) for expert, lo, hi in zip(experts, bounds[:-1], bounds[1:], strict=True)]
    pieces.append(x.new_zeros(x.shape[0] - bounds[-1], x.shape[1]))  # rows past the last run
    return torch.cat(pieces)
