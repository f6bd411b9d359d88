"""The gated feed-forward block (SwiGLU): ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``silu(gate) * up``: the weight-free product of the MLP, a module (``mlp.act``) so selective
    activation checkpointing can recompute it instead of keeping ``silu(gate)`` and the product."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class GatedMLP(nn.Module):
    """SwiGLU feed-forward block with Hugging Face's names (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__()
        h, i = hidden_size, intermediate_size
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(h, i, bias=bias, **kw)
        self.up_proj = nn.Linear(h, i, bias=bias, **kw)
        self.down_proj = nn.Linear(i, h, bias=bias, **kw)
        self.act = SwiGLU()

    def project_in(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project_in(x)
        return self.down_proj(self.act(gate, up))
