"""Deferred weight-gradient GEMMs: the ``W`` half of a split backward (zero-bubble pipelines).

A zero-bubble pipeline schedule (``zb-h1``) splits each stage's backward into ``B`` (the input
gradient, which the previous stage waits for) and ``W`` (the weight gradients, which nobody waits
for until the optimizer step) and places ``W`` in the bubbles. Nothing here edits the autograd
graph: the column- and row-parallel matmul functions (:mod:`plait.tensor_parallel.column_matmul`,
:mod:`plait.tensor_parallel.linear`, also behind :class:`~plait.tensor_parallel.linear.DeferrableLinear`,
the plain projections of a model without tensor parallelism) ask the :class:`WeightGradQueue` they
were given whether to defer; while a ``B`` runs under :meth:`WeightGradQueue.collect`, their
backward returns ``None`` for the weight and leaves ``(param, output grad, input)`` in the queue instead of computing
``dW = dY^T X``. :meth:`WeightGradQueue.run` (the ``W`` task) computes those products and hands them
to autograd with ``torch.autograd.backward(params, dWs)``: they go through each parameter's own
gradient accumulator, so ``.grad`` accumulates and post-accumulate hooks (the data-parallel
gradient buffer and its bucket reductions) fire exactly as in an unsplit backward, only later.
(Autograd also runs a deferred weight's post-accumulate hooks during ``B``, with ``.grad`` still
``None``: hooks must ignore that call, as ``GradSync`` does.)

Every other parameter (norms, embeddings, biases, LoRA adapters, a weight tied to another module
of the same stage) keeps getting its gradient in ``B``. Memory: a deferred entry keeps the layer's
input and output gradient alive from ``B`` to ``W`` (under sequence parallelism the *gathered*
input), which is what ``W`` needs; the rest of the microbatch's activations are freed by ``B``.

The queue is owned by whoever runs the schedule (one per :class:`~plait.pipeline.runtime.
PipelineRuntime`) and attached to the layers with
:func:`plait.tensor_parallel.weight_grad_attach.attach_weight_grad_queue`; it is a plain
object read from the autograd engine's thread (CUDA runs backward on a device thread), so no
thread-local or global state is involved.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class _Deferred:
    """One weight's gradient, ``grad_out^T @ inputs`` cast to ``param``'s dtype, not yet computed."""

    param: torch.Tensor
    grad_out: torch.Tensor  # [tokens, out] in the matmul's compute dtype
    inputs: torch.Tensor  # [tokens, in] in the matmul's compute dtype


class WeightGradQueue:
    """Weight-gradient products deferred from ``B`` tasks, run by the matching ``W`` task."""

    def __init__(self) -> None:
        self._open: list[_Deferred] | None = None
        self._pending: dict[Hashable, list[_Deferred]] = {}

    @contextmanager
    def collect(self, key: Hashable) -> Iterator[None]:
        """Defer the weight gradients of the backward run inside this block under ``key``."""
        if self._open is not None:
            raise RuntimeError("WeightGradQueue.collect() blocks do not nest")
        if key in self._pending:
            raise RuntimeError(f"weight gradients of {key!r} are already deferred and not yet run")
        self._open = []
        try:
            yield
        finally:
            self._pending[key], self._open = self._open, None

    def defer(self, param: torch.Tensor, grad_out: torch.Tensor, inputs: torch.Tensor) -> bool:
        """Called from a matmul's backward: queue ``dW = grad_out^T inputs`` for ``param`` and return
        True, or return False (compute it now) outside :meth:`collect`."""
        if self._open is None:
            return False
        self._open.append(_Deferred(param, grad_out.detach(), inputs.detach()))
        return True

    def run(self, key: Hashable) -> None:
        """Compute the weight gradients deferred under ``key`` and accumulate them through autograd."""
        entries = self._pending.pop(key, None)
        if entries is None:
            raise RuntimeError(f"no weight gradients deferred under {key!r} (a W task must follow its B)")
        if not entries:
            return
        params = [e.param for e in entries]
        with torch.no_grad():
            grads = [e.grad_out.t().matmul(e.inputs).to(e.param.dtype) for e in entries]
        entries.clear()  # release the kept activations before autograd accumulates
        torch.autograd.backward(params, grads)

    def pending(self) -> list[Hashable]:
        """Keys whose weight gradients are deferred and not yet run (empty after a full schedule)."""
        return list(self._pending)
