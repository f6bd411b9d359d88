"""One optimizer step: microbatches with gradient accumulation, DP reduction, clipping, update.

Gradients accumulate in the optimizer's flat buffer; the data-parallel reduction of each bucket
starts during the last microbatch's backward (under pipeline parallelism, during each stage's
last backward) and is awaited before the norm. No host synchronisation happens here: the loss
and the gradient norm are returned as device tensors.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn

from plait.data_parallel.optimizer import DistributedOptimizer
from plait.train.precision import PrecisionPolicy

#: ``watch(operation, axis)`` -> a context manager timing a communicating phase (see train/watchdog.py)
Watch = Callable[[str, str], ContextManager]


def no_watch(operation: str, axis: str) -> ContextManager:  # noqa: ARG001 - same signature as a Watch
    return contextlib.nullcontext()


def finish_step(optimizer: DistributedOptimizer, grad_clip: float, loss: torch.Tensor | None = None,
                skip_nonfinite: bool = False, watch: Watch = no_watch) -> torch.Tensor:
    """Wait for the reductions, take the global norm, clip, update. Returns the pre-clip norm.

    With ``skip_nonfinite`` a step whose norm (or ``loss``) is not finite changes nothing: the
    decision stays on the device (see :meth:`DistributedOptimizer.step`).
    """
    with watch("data-parallel gradient reduction", "dp"):
        optimizer.grads.finish()
    with watch("gradient-norm all-reduce", "tp, pp and dp"):
        norm = optimizer.grad_norm()
    found = None
    if skip_nonfinite:
        ok = torch.isfinite(norm) if loss is None else torch.isfinite(norm) & torch.isfinite(loss)
        found = (~ok).float()
    optimizer.clip_(norm, grad_clip)
    with watch("optimizer step (ZeRO-1 parameter all-gather)", "dp"):
        optimizer.step(found_inf=found)
    return norm


def train_step(model: nn.Module, optimizer: DistributedOptimizer, batch: torch.Tensor, *, grad_clip: float,
               policy: PrecisionPolicy, skip_nonfinite: bool = False,
               watch: Watch = no_watch) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch``: ``[microbatches, micro_batch, seq]``. Returns (mean loss, pre-clip grad norm)."""
    device = optimizer.param_data.device
    microbatches = batch.shape[0]
    total = torch.zeros((), device=device)
    for mb in range(microbatches):
        ids = batch[mb].to(device, non_blocking=True)
        if mb == microbatches - 1:
            optimizer.grads.mark_final()
        with watch("forward/backward (tensor-parallel collectives)", "tp"):
            with policy.compute_context(device):
                loss = model(ids, ids)
            (loss / microbatches).backward()
        total += loss.detach().float()
    loss = total / microbatches
    return loss, finish_step(optimizer, grad_clip, loss, skip_nonfinite, watch)


def pipeline_train_step(runtime, optimizer: DistributedOptimizer, batch: torch.Tensor, *,
                        grad_clip: float, skip_nonfinite: bool = False,
                        watch: Watch = no_watch) -> tuple[torch.Tensor, torch.Tensor]:
    """One step under pipeline parallelism: the schedule, then the same reductions as ``train_step``.

    The runtime calls ``optimizer.grads.mark_final`` before each stage's last backward (see
    :meth:`Trainer <plait.train.trainer.Trainer>` wiring). Returns (loss, grad norm) as device
    tensors; the loss is non-zero on the last stage only.
    """
    with watch("pipeline schedule (point-to-point and tensor-parallel collectives)", "pp"):
        loss = runtime.run(batch, train=True)
    # the loss lives on the last stage only; a non-finite loss makes the gradients, hence the norm
    # that every stage shares, non-finite too
    return loss, finish_step(optimizer, grad_clip, None, skip_nonfinite, watch)
