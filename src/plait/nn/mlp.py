"""The feed-forward blocks: gated (SwiGLU, ``down(silu(gate(x)) * up(x))``, or GeGLU and other gated
activations, ``down(act(gate(x)) * up(x))``) and plain (``dense_4h_to_h(act(dense_h_to_4h(x)))``,
GPT-NeoX's GeLU MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``silu(gate) * up``: the weight-free product of the MLP, a module (``mlp.act``) so selective
    activation checkpointing can recompute it instead of keeping ``silu(gate)`` and the product."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class GatedActivation(nn.Module):
    """``act(gate) * up`` for the activation Hugging Face's ``hidden_act`` / ``hidden_activation``
    names (GeGLU with ``gelu_pytorch_tanh``: Gemma's MLP); weight-free, like :class:`SwiGLU`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = activation(name)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.fn(gate) * up

    def extra_repr(self) -> str:
        return f"act={self.name!r}"


def gated_activation(name: str) -> nn.Module:
    """The weight-free product of a gated MLP whose gate goes through ``name``: :class:`SwiGLU` for
    ``silu``, a :class:`GatedActivation` otherwise."""
    return SwiGLU() if name == "silu" else GatedActivation(name)


class GatedMLP(nn.Module):
    """Gated feed-forward block with Hugging Face's names (``gate_proj``, ``up_proj``, ``down_proj``):
    SwiGLU, or ``act(gate) * up`` for another ``act`` (Gemma's GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False, act: str = "silu",
                 device=None, dtype=None) -> None:
        super().__init__()
        h, i = hidden_size, intermediate_size
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(h, i, bias=bias, **kw)
        self.up_proj = nn.Linear(h, i, bias=bias, **kw)
        self.down_proj = nn.Linear(i, h, bias=bias, **kw)
        self.act = gated_activation(act)

    def project_in(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project_in(x)
        return self.down_proj(self.act(gate, up))


#: ``hidden_act`` values of a plain MLP (Hugging Face's names) -> the module computing them. ``gelu``
#: is the exact (erf) GeLU; ``gelu_new``, ``gelu_pytorch_tanh`` and ``gelu_fast`` its tanh approximation
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu")


def activation(name: str) -> nn.Module:
    """The activation module Hugging Face's ``hidden_act`` ``name`` stands for (see :data:`ACTIVATIONS`)."""
    if name == "gelu":
        return nn.GELU()
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return nn.GELU(approximate="tanh")
    if name == "relu":
        return nn.ReLU()
    if name == "silu":
        return nn.SiLU()
    raise ValueError(f"hidden_act={name!r} is not supported; valid: {', '.join(map(repr, ACTIVATIONS))}")


class DenseMLP(nn.Module):
    """The plain (ungated) feed-forward block with Hugging Face's GPT-NeoX names: ``dense_h_to_4h``,
    the activation ``act`` (a module of its own, so selective activation checkpointing can name
    ``mlp.act``) and ``dense_4h_to_h``."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "gelu", *, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.dense_h_to_4h = nn.Linear(hidden_size, intermediate_size, **kw)
        self.act = activation(act)
        self.dense_4h_to_h = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))
