"""A minimal tensor-parallel training loop: AdamW on fixed batches, one loss per step.

The loop behind the tensor-parallel loss-parity tests (the library's own loop is
:mod:`plait.train.trainer`). Every rank of a TP group sees the same batch; sharded and
replicated parameters are updated locally (replicated ones receive
identical gradients on every TP rank, so they stay identical).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from token_sequences import batch_at


def no_decay(name: str) -> bool:
    """Norm weights and biases are not decayed."""
    return name.endswith(".bias") or "norm" in name


def adamw_for(model: nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if not no_decay(n)]
    keep = [p for n, p in model.named_parameters() if no_decay(n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": keep, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def train_steps(model: nn.Module, seqs: torch.Tensor, *, steps: int, batch_size: int, lr: float,
                seed: int = 0, on_step: Callable[[int, float, float], None] | None = None) -> list[float]:
    """Run ``steps`` AdamW steps and return the per-step losses (``on_step(step, loss, seconds)``)."""
    opt = adamw_for(model, lr)
    losses = []
    for step in range(steps):
        start = time.perf_counter()
        batch = batch_at(seqs, step, batch_size, seed)
        loss = model(batch, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], time.perf_counter() - start)
    return losses


@torch.no_grad()
def evaluate(model: nn.Module, seqs: torch.Tensor, batch_size: int) -> float:
    """Mean loss over ``seqs`` (in batches)."""
    total, count = 0.0, 0
    for i in range(0, seqs.shape[0] - batch_size + 1, batch_size):
        total += model(seqs[i:i + batch_size], seqs[i:i + batch_size]).item()
        count += 1
    return total / max(count, 1)
