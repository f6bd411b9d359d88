"""Normalisation layers: root-mean-square (over the hidden size or over each attention head) and
layer norm with a bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dimension, computed in fp32 and cast back before the
    weight multiplies (Hugging Face's order, so results match it bit for bit in fp32)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled by a learned weight (Llama's ``LlamaRMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class HeadRMSNorm(RMSNorm):
    """RMSNorm over each head of a ``[..., heads * head_dim]`` projection, one weight of size
    ``head_dim`` shared by every head (Qwen3's ``q_norm``/``k_norm``).

    Takes and returns the flat projection, so it slots between the q/k projections and the
    attention core whatever number of heads this rank holds.
    """

    def __init__(self, head_dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__(head_dim, eps, device=device, dtype=dtype)
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_heads(x, self.weight)

    def norm_heads(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return rms_norm(x.view(*shape[:-1], -1, self.head_dim), weight, self.eps).view(shape)


class LayerNorm(nn.Module):
    """Layer norm over the last dimension with a learned weight and bias (GPT-NeoX's
    ``input_layernorm``, ``post_attention_layernorm`` and ``final_layer_norm``).

    ``torch.nn.functional.layer_norm`` in the input's dtype, as ``torch.nn.LayerNorm`` computes it
    (its kernels accumulate the statistics in fp32 for bf16 inputs), so fp32 results match
    Hugging Face's bit for bit.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
