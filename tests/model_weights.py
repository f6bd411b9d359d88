"""Weights for parity tests against transformers: non-trivial values in every parameter."""

from __future__ import annotations

import torch


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (HF init leaves norms at 1 and biases at 0, which hides bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)
