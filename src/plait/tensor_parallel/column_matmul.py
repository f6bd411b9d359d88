"""The column-parallel matmul as one autograd function, with communication overlapped in backward.

One function serves one or several weights that read the same input (q/k/v, gate/up), so the
input is gathered once and its gradient reduced once.

Forward: (sequence parallel) all-gather the input along the sequence; ``y_i = x W_i^T + b_i``.
Backward: ``dx = sum_i s_i * dy_i W_i``; its all-reduce (or reduce-scatter under sequence
parallelism) is started asynchronously and the weight gradients ``dW_i = dy_i^T x`` are computed
while it is in flight. Under sequence parallelism the input is re-gathered in backward instead of
being kept, which keeps the activation memory at the sequence shard (the gather overlaps with the
input-gradient matmul). ``s_i`` are per-weight input-gradient scales (KV replication uses ``1/m``).

With a :class:`~plait.tensor_parallel.weight_grad.WeightGradQueue` (zero-bubble pipeline schedules)
the weight-gradient products can be deferred: while the queue collects, backward returns ``None``
for each weight that needs a gradient and queues ``(weight, dy_i, x)`` for the schedule's ``W`` task.

Autocast is honoured: under an active autocast the matmuls run in the autocast dtype and the
gradients are returned in the parameters' own dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from plait.comm import primitives as P

if TYPE_CHECKING:
    from plait.tensor_parallel.weight_grad import WeightGradQueue


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _gather_async(x: torch.Tensor, dim: int, group):
    n = P.group_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * front.shape[0],) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    work = P.all_gather_single(out, front, group=group, async_op=True)
    return out, work


#: position of the first weight among ``_ColumnParallelMatmul.forward``'s inputs (for needs_input_grad)
_PARAMS_AT = 6


class _ColumnParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sequence_parallel, seq_dim, grad_scales, weight_grad_queue, *params):
        cdtype = _compute_dtype(x)
        n = len(params) // 2
        weights = [params[2 * i].to(cdtype) for i in range(n)]
        biases = [None if params[2 * i + 1] is None else params[2 * i + 1].to(cdtype) for i in range(n)]
        x_local = x.to(cdtype)
        x_full = P.all_gather_dim(x_local, seq_dim, group) if sequence_parallel else x_local
        with torch.autocast(x.device.type, enabled=False):
            outs = tuple(torch.nn.functional.linear(x_full, w, b) for w, b in zip(weights, biases, strict=True))
        ctx.save_for_backward(x_local if sequence_parallel else x_full, *weights)
        ctx.group, ctx.sp, ctx.seq_dim, ctx.grad_scales = group, sequence_parallel, seq_dim, grad_scales
        ctx.has_bias = [b is not None for b in biases]
        ctx.param_dtypes = [p.dtype if p is not None else None for p in params]
        ctx.x_dtype = x.dtype
        ctx.queue = weight_grad_queue
        ctx.weight_params = [params[2 * i] for i in range(n)] if weight_grad_queue is not None else None
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x_saved, *weights = ctx.saved_tensors
        group, sp, seq_dim = ctx.group, ctx.sp, ctx.seq_dim
        multi_rank = P.group_size(group) > 1
        gather_work = None
        if sp and multi_rank:
            x_front, gather_work = _gather_async(x_saved, seq_dim, group)
        dx = None
        for g, w, s in zip(grads, weights, ctx.grad_scales, strict=True):
            if g is None:
                continue
            part = g.to(w.dtype).matmul(w)
            if s != 1.0:
                part = part * s
            dx = part if dx is None else dx + part
        if gather_work is not None:
            gather_work.wait()
            x_full = x_front.movedim(0, seq_dim)
        else:
            x_full = x_saved
        reduce_work = None
        if dx is not None and multi_rank:
            if sp:
                dx, reduce_work = P.reduce_scatter_dim(dx, seq_dim, group, async_op=True)
            else:
                dx = dx.contiguous()
                reduce_work = P.all_reduce(dx, group, async_op=True)
        x2d = x_full.reshape(-1, x_full.shape[-1])
        param_grads: list[torch.Tensor | None] = []
        for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
            if g is None:
                param_grads += [None, None]
                continue
            g2d = g.reshape(-1, g.shape[-1]).to(w.dtype)
            needs_dw = ctx.needs_input_grad[_PARAMS_AT + 2 * i]
            if needs_dw and ctx.queue is not None and ctx.queue.defer(ctx.weight_params[i], g2d, x2d):
                dw = None
            else:
                dw = g2d.t().matmul(x2d).to(ctx.param_dtypes[2 * i])
            db = g2d.sum(0).to(ctx.param_dtypes[2 * i + 1]) if ctx.has_bias[i] else None
            param_grads += [dw, db]
        if reduce_work is not None:
            reduce_work.wait()
        if dx is not None:
            dx = dx.to(ctx.x_dtype)
        return (dx, None, None, None, None, None, *param_grads)


def column_parallel_matmul(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group,
    *,
    sequence_parallel: bool = False,
    seq_dim: int = 1,
    input_grad_scales: Sequence[float] | None = None,
    weight_grad_queue: WeightGradQueue | None = None,
) -> tuple[torch.Tensor, ...]:
    """``[x W_i^T + b_i for i]`` on the full (gathered) input, with a single input-gradient reduce.

    ``weight_grad_queue``: where backward may defer the weight-gradient products (see module doc).
    """
    scales = tuple(input_grad_scales or [1.0] * len(weights))
    params: list[torch.Tensor | None] = []
    for w, b in zip(weights, biases, strict=True):
        params += [w, b]
    return _ColumnParallelMatmul.apply(x, group, sequence_parallel, seq_dim, scales, weight_grad_queue, *params)
