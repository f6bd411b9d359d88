"""Tensor-parallel MLPs: SwiGLU (gate/up column-parallel with one shared input, down row-parallel)
and the plain MLP (``dense_h_to_4h`` column-parallel, ``dense_4h_to_h`` row-parallel)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.nn.mlp import activation, gated_activation
from plait.tensor_parallel.column_matmul import column_parallel_matmul
from plait.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear


class ParallelGatedMLP(nn.Module):
    """The gated MLP of :class:`plait.nn.mlp.GatedMLP` split over the TP group (``act``: the gate's
    activation, ``silu`` for SwiGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: GroupInfo, *, bias: bool = False,
                 sequence_parallel: bool = False, act: str = "silu", device=None, dtype=None) -> None:
        super().__init__()
        if intermediate_size % tp.size:
            raise ValueError(
                f"intermediate_size={intermediate_size} is not divisible by tp={tp.size}; choose a tp "
                f"that divides it"
            )
        self.tp, self.sequence_parallel = tp, sequence_parallel
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp, **kw)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp, **kw)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp,
                                           sequence_parallel=sequence_parallel, **kw)
        self.act = gated_activation(act)  # a submodule so selective activation checkpointing can name ``mlp.act``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_parallel_matmul(
            x, [self.gate_proj.weight, self.up_proj.weight], [self.gate_proj.bias, self.up_proj.bias],
            self.tp.group, sequence_parallel=self.sequence_parallel,
            weight_grad_queue=self.gate_proj.weight_grad_queue)
        return self.down_proj(self.act(gate, up))


class ParallelDenseMLP(nn.Module):
    """The plain MLP of :class:`plait.nn.mlp.DenseMLP` split over the TP group: ``dense_h_to_4h``'s
    output features (and bias) sharded, the activation on the local features, ``dense_4h_to_h``'s
    input features sharded and its bias replicated (added once, after the reduction)."""

    #: its forward calls each projection as a module (no fused matmul), so a LoRA adapter on one adds
    #: itself in that projection's own forward (see :mod:`plait.lora.apply`)
    calls_its_projections: ClassVar[bool] = True

    def __init__(self, hidden_size: int, intermediate_size: int, tp: GroupInfo, act: str = "gelu", *,
                 bias: bool = True, sequence_parallel: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        if intermediate_size % tp.size:
            raise ValueError(
                f"intermediate_size={intermediate_size} is not divisible by tp={tp.size}; choose a tp "
                f"that divides it"
            )
        self.tp, self.sequence_parallel = tp, sequence_parallel
        kw = {"bias": bias, "sequence_parallel": sequence_parallel, "device": device, "dtype": dtype}
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, intermediate_size, tp, **kw)
        self.act = activation(act)
        self.dense_4h_to_h = RowParallelLinear(intermediate_size, hidden_size, tp, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))
