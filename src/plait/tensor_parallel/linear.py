"""Column- and row-parallel linear layers.

``ColumnParallelLinear`` splits the output features over the TP group (``W`` is ``[out, in]``;
rank r holds the rows its :class:`ShardSpec` names). ``RowParallelLinear`` splits the input
features and sums the partial products over the group. A column layer followed by a row layer
needs one collective in forward and one in backward (Megatron's f/g).

With ``sequence_parallel`` the activations outside the pair are sharded along the sequence:
the column layer all-gathers its input and the row layer reduce-scatters its output.

Both layers carry ``weight_grad_queue`` (``None`` by default): a zero-bubble pipeline schedule sets
it (:func:`plait.tensor_parallel.weight_grad_attach.attach_weight_grad_queue`) so their weight-gradient
products can be deferred from the input-gradient backward to a later ``W`` task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.comm import collectives as C
from plait.comm.primitives import GroupInfo
from plait.tensor_parallel.column_matmul import column_parallel_matmul
from plait.tensor_parallel.sharding import ShardSpec

if TYPE_CHECKING:
    from plait.tensor_parallel.weight_grad import WeightGradQueue


def even_rows(full: int, tp: GroupInfo, pad_to_multiple: bool = False) -> tuple[int, ...]:
    """Indices of rank ``tp.rank``'s contiguous share of ``full`` rows (padding marked -1)."""
    if full % tp.size and not pad_to_multiple:
        raise ValueError(f"size {full} is not divisible by the tensor-parallel degree {tp.size}")
    per = -(-full // tp.size)
    return tuple(i if i < full else -1 for i in range(tp.rank * per, (tp.rank + 1) * per))


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s output rows sharded over the TP group.

    Args:
        rows: the full-tensor output rows this rank holds (default: an even contiguous share).
        replicas: how many ranks hold each row (the KV replication factor for K/V projections).
        gather_output: all-gather the output features (otherwise the output stays sharded).
        gather_input: run the entry collective here (copy-to-TP, or the sequence all-gather). Set
            False when a module shares one gathered input between several column layers and calls
            :func:`column_parallel_matmul` itself.
    """

    def __init__(self, in_features: int, out_features: int, tp: GroupInfo, *, bias: bool = False,
                 sequence_parallel: bool = False, gather_output: bool = False,
                 rows: tuple[int, ...] | None = None, replicas: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        self.tp, self.sequence_parallel, self.gather_output = tp, sequence_parallel, gather_output
        self.in_features, self.out_features = in_features, out_features
        rows = even_rows(out_features, tp) if rows is None else rows
        self.weight_spec = ShardSpec(0, rows, (out_features, in_features), replicas)
        self.weight = nn.Parameter(torch.empty(len(rows), in_features, device=device, dtype=dtype))
        if bias:
            self.bias_spec = ShardSpec(0, rows, (out_features,), replicas)
            self.bias = nn.Parameter(torch.empty(len(rows), device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        #: where backward may defer the weight gradient (zero-bubble schedules); ``None``: never
        self.weight_grad_queue: WeightGradQueue | None = None

    def shard_specs(self) -> dict[str, ShardSpec]:
        specs = {"weight": self.weight_spec}
        if self.bias is not None:
            specs["bias"] = self.bias_spec
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = column_parallel_matmul(x, [self.weight], [self.bias], self.tp.group,
                                      sequence_parallel=self.sequence_parallel,
                                      weight_grad_queue=self.weight_grad_queue)
        if self.gather_output:
            y = C.gather_from_tp(y, -1, self.tp.group)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, local_out={self.weight.shape[0]}, "
                f"tp={self.tp.size}, sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r W_r^T + b`` with ``W``'s input columns sharded over the TP group.

    The input is expected already split along its last dim (the output of a column layer). The
    bias is replicated and added once, after the reduction. Under sequence parallelism the sum
    is a reduce-scatter along ``seq_dim`` and the bias gradient is summed over the group.
    """

    def __init__(self, in_features: int, out_features: int, tp: GroupInfo, *, bias: bool = False,
                 sequence_parallel: bool = False, cols: tuple[int, ...] | None = None,
                 seq_dim: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        self.tp, self.sequence_parallel, self.seq_dim = tp, sequence_parallel, seq_dim
        self.in_features, self.out_features = in_features, out_features
        cols = even_rows(in_features, tp) if cols is None else cols
        self.weight_spec = ShardSpec(1, cols, (out_features, in_features))
        self.weight = nn.Parameter(torch.empty(out_features, len(cols), device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        #: where backward may defer the weight gradient (zero-bubble schedules); ``None``: never
        self.weight_grad_queue: WeightGradQueue | None = None

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.weight_spec}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_queue is None:
            y = torch.nn.functional.linear(x, self.weight)
        else:
            y = _DeferrableLinear.apply(x, self.weight, None, self.weight_grad_queue)
        if self.sequence_parallel:
            y = C.reduce_scatter_to_sp(y, self.seq_dim, self.tp.group)
        else:
            y = C.reduce_from_tp(y, self.tp.group)
        if self.bias is not None:
            bias = C.all_reduce_grad(self.bias, self.tp.group) if self.sequence_parallel else self.bias
            y = y + bias
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, local_in={self.weight.shape[1]}, "
                f"tp={self.tp.size}, sp={self.sequence_parallel}")


class DeferrableLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient a :class:`WeightGradQueue` may defer.

    Without tensor parallelism the models keep plain ``nn.Linear`` projections; a zero-bubble
    schedule switches those instances to this class
    (:func:`~plait.tensor_parallel.weight_grad_attach.attach_weight_grad_queue`, the same class swap
    LoRA uses), so they split their backward like the parallel layers. Without a queue it is
    ``nn.Linear``.
    """

    weight_grad_queue: WeightGradQueue | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_queue is None:
            return super().forward(x)
        return _DeferrableLinear.apply(x, self.weight, self.bias, self.weight_grad_queue)


class _DeferrableLinear(torch.autograd.Function):
    """``x W^T (+ b)`` whose weight gradient a queue may defer (the bias gradient stays in backward).

    The same products as ``torch.nn.functional.linear`` under the same autocast: the operands in
    the autocast dtype, the input gradient returned in the input's dtype and the parameter
    gradients in the parameters'.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, queue):
        dev = x.device.type
        cdtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        x_c, w_c = x.to(cdtype), weight.to(cdtype)
        with torch.autocast(dev, enabled=False):
            y = torch.nn.functional.linear(x_c, w_c, None if bias is None else bias.to(cdtype))
        ctx.save_for_backward(x_c, w_c)
        ctx.queue, ctx.weight, ctx.x_dtype = queue, weight, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        x_c, w_c = ctx.saved_tensors
        grad = grad.to(w_c.dtype)
        dx = grad.matmul(w_c).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        g2d, x2d = grad.reshape(-1, grad.shape[-1]), x_c.reshape(-1, x_c.shape[-1])
        dw = None
        if ctx.needs_input_grad[1] and not ctx.queue.defer(ctx.weight, g2d, x2d):
            dw = g2d.t().matmul(x2d).to(ctx.weight.dtype)
        db = g2d.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class ReplicatedLinear(nn.Linear):
    """``nn.Linear`` whose weight (and bias) every TP rank holds whole.

    Without sequence parallelism its input is the same on every rank, and so are its output and
    gradients: it is a plain linear layer. Under sequence parallelism each rank projects its own
    sequence shard, so the parameter gradients are summed over the TP group in backward (as a
    sequence-parallel norm's are). Used where a small projection is cheaper to repeat than to shard
    (multi-head latent attention's compressions, a prediction module's input projection).
    """

    def __init__(self, in_features: int, out_features: int, tp: GroupInfo, *, bias: bool = False,
                 sequence_parallel: bool = False, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return super().forward(x)
        group = self.tp.group
        bias = None if self.bias is None else C.all_reduce_grad(self.bias, group)
        return torch.nn.functional.linear(x, C.all_reduce_grad(self.weight, group), bias)
