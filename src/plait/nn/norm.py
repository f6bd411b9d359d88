"""Normalisation layers: root-mean-square (over the hidden size or over each attention head) and
layer norm with a bias.

An RMS norm's weight multiplies as ``w`` (Llama) or, in its offset form, as ``1 + w`` with the
weight stored as the offset and initialised to zero (Gemma's ``(1 + weight)``): the ``offset``
class attribute chooses, so every RMS norm here (and the tensor-parallel ones derived from them)
exists in both forms.
"""

from __future__ import annotations

from typing import ClassVar

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


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight) * x / rms(x)`` over the last dimension, all in fp32 and cast back to ``x``'s
    dtype only at the end (the offset form: the weight multiplies before the cast, unlike
    :func:`rms_norm`)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled by a learned weight (Llama's ``LlamaRMSNorm``)."""

    #: the weight multiplies as ``1 + weight`` (stored as the offset, initialised to zero) rather than as ``weight``
    offset: ClassVar[bool] = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        init = torch.zeros if self.offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    @property
    def initial_constant(self) -> float:
        """The weight's initial value (read by :mod:`plait.init`): 1, or 0 for the offset form."""
        return 0.0 if self.offset else 1.0

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x`` normalised over its last dimension and scaled by ``weight`` (or ``1 + weight``)."""
        return (offset_rms_norm if self.offset else rms_norm)(x, weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` in fp32 (Gemma's ``Gemma3RMSNorm``); the weight starts at zero."""

    offset = True


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
        return self.normalize(x.view(*shape[:-1], -1, self.head_dim), weight).view(shape)


class HeadOffsetRMSNorm(HeadRMSNorm):
    """:class:`HeadRMSNorm` scaled by ``1 + weight`` (Gemma 3's ``q_norm``/``k_norm``)."""

    offset = True


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
