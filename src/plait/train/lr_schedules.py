"""Learning-rate schedules: linear warm-up, then cosine or linear decay to a floor, or constant."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, name: str, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if name == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif name == "linear":
        decay = 1.0 - progress
    else:
        raise ValueError(f"scheduler.name={name!r} is not valid; choose cosine, linear or constant")
    return min_ratio + (1.0 - min_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, *, name: str, warmup_steps: int, total_steps: int,
                    min_ratio: float, last_epoch: int = -1) -> torch.optim.lr_scheduler.LambdaLR:
    """``last_epoch``: the last step already taken (-1: none); resuming needs ``initial_lr`` in the
    optimizer's parameter groups, as for any PyTorch scheduler."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, name=name, warmup_steps=warmup_steps,
                                          total_steps=total_steps, min_ratio=min_ratio), last_epoch=last_epoch)
