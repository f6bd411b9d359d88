"""AdamW with decoupled weight decay, no decay on norms and biases, and no host reads per step.

The fused implementation is used where PyTorch has it (CPU and CUDA): besides being faster, it
keeps the step counters on the device, whereas the per-tensor loop reads each counter back to
the host (``.item()``) on every step.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights, biases and other 1-D parameters are not decayed."""
    return param.dim() < 2 or name.endswith(".bias") or "norm" in name


def build_adamw(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                eps: float) -> torch.optim.AdamW:
    decay, keep = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (keep if no_weight_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    kwargs = {"lr": lr, "betas": betas, "eps": eps}
    if "fused" in inspect.signature(torch.optim.AdamW).parameters:
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs)
