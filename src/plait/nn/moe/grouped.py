"""Grouped matrix multiply: one matmul per expert over that expert's contiguous run of rows, in one call.

``torch._grouped_mm(x [N, K], w [E, K, M], offs=ends)`` multiplies rows ``ends[e-1]:ends[e]`` of
``x`` by ``w[e]`` without reading ``ends`` on the host. Its forward works on CPU and on CUDA
(bf16, compute capability 9.0 and up), but its built-in backward fails on CPU, so
:class:`GroupedLinear` supplies the backward from the same primitive. Where it is not available
(other devices or dtypes, or sizes whose rows are not multiples of 16 bytes) the caller loops
over experts instead (:func:`grouped_mm_usable`). Rows past ``ends[-1]`` are left undefined;
callers mask them.

The weights are taken in ``nn.Linear``'s layout ``[E, out, in]`` (:func:`grouped_linear`), the
layout of the expert parameters themselves: the backward then writes the weight gradient as
``[E, out, in]`` blocks (``dw = gmm(dy^T, x)``), so when the caller stacked the experts'
weights, autograd's unstacking hands each parameter a contiguous slice that it keeps as the
gradient. With the transposed ``[E, in, out]`` layout every expert's gradient would be a
transposed view, copied once more before it is accumulated (one copy per expert weight per step).
"""

from __future__ import annotations

import torch


def grouped_mm_usable(x: torch.Tensor, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` runs here for inputs like ``x`` and inner sizes ``dims``."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any((d * x.element_size()) % 16 for d in dims):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


class GroupedLinear(torch.autograd.Function):
    """``y[ends[e-1]:ends[e]] = x[ends[e-1]:ends[e]] @ w[e]^T`` (``w`` ``[E, out, in]``) with an
    explicit backward: ``dx = gmm(dy, w)``, ``dw = gmm(dy^T, x)`` (the 2-D x 2-D form, one
    ``[out, in]`` block per group; an empty group gets a zero block)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, ends)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, ends = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch._grouped_mm(grad, w, offs=ends) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(grad.t(), x, offs=ends) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Grouped ``x @ w[e]^T`` (``x`` ``[N, in]``, ``w`` ``[E, out, in]``, ``ends`` int32 ``[E]``)."""
    return GroupedLinear.apply(x, w, ends)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Grouped ``x @ w[e]`` (``x`` ``[N, K]``, ``w`` ``[E, K, M]``, ``ends`` int32 ``[E]``)."""
    return grouped_linear(x, w.transpose(-2, -1), ends)
