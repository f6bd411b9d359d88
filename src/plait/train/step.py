"""One optimizer step: microbatches with gradient accumulation, DP averaging, clipping, update.

No host synchronisation happens here: the loss and the gradient norm are returned as device
tensors.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.train.dp_sync import average_gradients
from plait.train.grad_norm import clip_by_norm_, global_grad_norm


def autocast_context(preset: str, device: torch.device):
    if preset == "autocast":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, *,
               tp: GroupInfo, dp: GroupInfo, grad_clip: float, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch``: ``[microbatches, micro_batch, seq]``. Returns (mean loss, pre-clip grad norm)."""
    device = next(model.parameters()).device
    microbatches = batch.shape[0]
    total = torch.zeros((), device=device)
    for mb in range(microbatches):
        ids = batch[mb].to(device, non_blocking=True)
        with autocast_context(precision, device):
            loss = model(ids, ids)
        (loss / microbatches).backward()
        total += loss.detach().float()
    average_gradients(model, dp)
    norm = global_grad_norm(model, tp)
    if grad_clip > 0:
        clip_by_norm_(model, norm, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / microbatches, norm


def pipeline_train_step(stages: list[nn.Module], runtime, optimizer: torch.optim.Optimizer, batch: torch.Tensor, *,
                        mesh, grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step under pipeline parallelism: the schedule, then the same reductions as ``train_step``.

    Returns (loss, grad norm) as device tensors; the loss is non-zero on the last stage only.
    """
    from plait.pipeline.tied import sync_tied_gradients

    loss = runtime.run(batch, train=True)
    for stage in stages:
        average_gradients(stage, mesh.info("dp"))
    sync_tied_gradients(stages, mesh)
    norm = global_grad_norm(stages, mesh.info("tp"), mesh.info("pp"))
    if grad_clip > 0:
        clip_by_norm_(stages, norm, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm
