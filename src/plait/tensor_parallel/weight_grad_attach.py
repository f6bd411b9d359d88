"""Switching a stage's linear layers to deferred weight gradients (zb-h1's split backward).

Apart from :mod:`plait.tensor_parallel.weight_grad` (the queue), which the layers' autograd
functions use, so that the queue module does not depend on the layer classes.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.tensor_parallel.linear import ColumnParallelLinear, DeferrableLinear, RowParallelLinear
from plait.tensor_parallel.weight_grad import WeightGradQueue


def attach_weight_grad_queue(module: nn.Module, queue: WeightGradQueue | None) -> list[torch.Tensor]:
    """Let every column/row-parallel linear layer in ``module``, and every plain ``nn.Linear`` (the
    projections of a model built without tensor parallelism, switched to
    :class:`~plait.tensor_parallel.linear.DeferrableLinear`), defer its weight gradient to
    ``queue`` (``None`` detaches); returns the weights attached. Subclasses of ``nn.Linear`` (LoRA's
    adapted projections) are left alone.

    A weight that is reachable under more than one name in ``module`` (an output head tied to the
    embedding of the same stage) is left alone: its other use accumulates in ``B``, and splitting
    its accumulation across ``B`` and ``W`` would change the order of the sum.
    """
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    attached: list[torch.Tensor] = []
    for m in module.modules():
        if type(m) is nn.Linear and queue is not None and uses.get(id(m.weight), 0) == 1:
            m.__class__ = DeferrableLinear
        if isinstance(m, ColumnParallelLinear | RowParallelLinear | DeferrableLinear):
            shared = uses.get(id(m.weight), 0) > 1
            m.weight_grad_queue = None if shared else queue
            if queue is not None and not shared:
                attached.append(m.weight)
    return attached


__all__ = ["attach_weight_grad_queue"]
