"""One optimizer step: the schedule's micro-batches with gradient accumulation, DP reduction,
clipping, update — the same function for every layout.

Gradients accumulate in the optimizer's flat buffer; the data-parallel reduction of each bucket
starts during each stage's last backward and is awaited before the norm. No host
synchronisation happens here: the loss and the gradient norm are returned as device tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from plait.data.batch import TokenBatch
from plait.data_parallel.optimizer import DistributedOptimizer

if TYPE_CHECKING:
    from plait.pipeline.runtime import PipelineRuntime

#: ``watch(operation, axis)`` -> a context manager timing a communicating phase (see train/watchdog.py)
Watch = Callable[[str, str], AbstractContextManager[None]]


def no_watch(operation: str, axis: str) -> AbstractContextManager[None]:  # noqa: ARG001 - same signature as a Watch
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


def train_step(runtime: PipelineRuntime, optimizer: DistributedOptimizer, batch: torch.Tensor | TokenBatch, *,
               grad_clip: float, skip_nonfinite: bool = False,
               watch: Watch = no_watch) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for every layout: the rank's schedule over ``batch`` (``[microbatches, micro_batch,
    seq]``; one stage and plain gradient accumulation without pipeline parallelism), then the
    reductions, norm, clipping and update of :func:`finish_step`.

    The runtime calls ``optimizer.grads.mark_final`` before each stage's last backward (wired by
    :func:`plait.train.build_run.build_run`). Returns (loss, grad norm) as device tensors; the loss
    is the mean over micro-batches on the rank holding the last stage and zero on the others.
    """
    with watch("forward/backward (pipeline point-to-point and tensor-parallel collectives)", "pp, tp"):
        loss = runtime.run(batch, train=True)
    # the loss lives on the last stage only; a non-finite loss makes the gradients, hence the norm
    # that every stage shares, non-finite too
    return loss, finish_step(optimizer, grad_clip, None, skip_nonfinite, watch)
