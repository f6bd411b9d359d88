"""Load-balancing losses of a router, and how they reach the gradients without touching the
training loss's path.

- :func:`load_balancing_loss`: the Switch Transformer / Mixtral auxiliary loss
  ``E * sum_i f_i * P_i`` over one micro-batch's ``T`` tokens, where ``f_i`` is the share of the
  ``T * k`` routing assignments that chose expert ``i`` (counted, no gradient; Hugging Face divides
  by ``T``, so a perfectly balanced router scores ``k``) and ``P_i`` the mean router probability
  of expert ``i`` (differentiable). ``f`` may also be given (``share``): the global-batch scope
  counts it over more tokens than the micro-batch's (:mod:`plait.moe.step_load`), while ``P``
  stays this micro-batch's.
- :func:`router_z_loss`: ST-MoE's ``mean_t logsumexp(logits_t)^2``, which keeps router logits small.

Each MoE layer adds ``scale * loss`` to the objective through :func:`add_loss_gradient`: an
identity on the layer's output whose backward also feeds ``scale`` as the loss's gradient. The
losses therefore need no channel to the last pipeline stage (a stage without MoE layers adds
nothing, a stage with some adds their gradients in its own backward), and they follow gradient
accumulation and data-parallel averaging through ``scale`` (the trainer sets it to
``coef / (micro-batches * MoE layers)``, matching its ``loss / micro-batches`` and DP mean).
"""

from __future__ import annotations

import torch


def assignments_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` count of routing assignments per expert (int64), on the device: no ``bincount``,
    whose output size would need a host read on CUDA."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor | None = None,
                        share: torch.Tensor | None = None) -> torch.Tensor:
    """Switch/Mixtral auxiliary loss of one micro-batch: ``probs`` ``[T, E]`` (fp32),
    ``experts`` ``[T, k]``; ``counts`` ``[E]`` may be passed when already computed. ``share`` ``[E]``
    (no gradient), when given, is ``f`` itself (assignments per token over whatever tokens the
    caller counted) and replaces ``counts / T``."""
    tokens, num_experts = probs.shape
    if share is None:
        if counts is None:
            counts = assignments_per_expert(experts, num_experts)
        share = counts.to(probs.dtype) / tokens
    return num_experts * (share.to(probs.dtype) * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss of ``logits`` ``[T, E]`` (fp32)."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class _AddLossGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def add_loss_gradient(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged; in the backward through it, ``loss`` receives gradient ``scale`` (as if
    ``scale * loss`` had been added to the objective). A no-op when ``scale`` is 0, when ``loss``
    has no gradient path or when autograd is off."""
    if scale == 0.0 or not (torch.is_grad_enabled() and loss.requires_grad):
        return x
    return _AddLossGradient.apply(x, loss, scale)
