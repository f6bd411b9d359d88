"""Routers: which experts each token goes to, and with what weight.

Router math runs in fp32 under every precision preset (autocast is switched off and the weight
is upcast): the top-k choice compares probabilities that differ in the third decimal, and a
bf16 softmax over many experts flips choices between otherwise identical runs.

Two routers share one output, :class:`Routing`:

- :class:`SoftmaxTopKRouter` (Mixtral, Qwen3-MoE): softmax over all experts, the top-k kept,
  optionally renormalised to sum to one (``renormalize``; Mixtral always, Qwen3-MoE per
  ``norm_topk_prob``).
- :class:`SigmoidTopKRouter` (DeepSeek-V3 style): independent sigmoid scores; the choice adds a
  per-expert ``expert_bias`` that is not trained by gradients but nudged after each step towards
  balanced load ("auxiliary-loss-free" balancing, :func:`update_expert_bias`); the combine
  weights are the unbiased scores of the chosen experts. Optionally group-limited: experts form
  ``num_groups`` groups, a token first picks ``topk_groups`` groups (by the sum of each group's two
  best biased scores) and then its top-k experts inside them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """A router's decision for ``T`` tokens over ``E`` experts, all fp32 except ``experts``.

    ``weights`` ``[T, k]``: combine weight of each chosen expert; ``experts`` ``[T, k]`` (int64):
    the chosen experts; ``logits`` ``[T, E]``: raw router logits (the z-loss reads them);
    ``probs`` ``[T, E]``: the per-expert probabilities the load-balancing loss averages.
    """

    weights: torch.Tensor
    experts: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fp32 with autocast off: ``[T, H] x [E, H] -> [T, E]``."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())


class SoftmaxTopKRouter(nn.Module):
    """Softmax over experts, top-k, optional renormalisation. Parameter ``weight`` ``[E, H]``
    (Hugging Face's ``gate.weight`` when the layer names this module ``gate``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, renormalize: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = router_logits(x, self.weight)
        probs = torch.softmax(logits, dim=-1)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(weights=top, experts=experts, logits=logits, probs=probs)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}"


class SigmoidTopKRouter(nn.Module):
    """Sigmoid scores, biased top-k choice, unbiased combine weights (see the module docstring).

    ``expert_bias`` ``[E]`` is a buffer (no gradient, kept in checkpoints); ``scale`` multiplies
    the combine weights (DeepSeek-V3's ``routed_scaling_factor``). ``probs`` for the auxiliary
    loss are the scores normalised over experts per token.
    """

    #: saved by training checkpoints (:func:`plait.checkpoint.writer.checkpointed_buffers`): resume is exact
    checkpoint_buffers = ("expert_bias",)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, renormalize: bool = True,
                 scale: float = 1.0, num_groups: int = 1, topk_groups: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if num_groups < 1 or num_experts % num_groups:
            raise ValueError(f"num_groups={num_groups} must divide num_experts={num_experts}")
        if not 1 <= topk_groups <= num_groups or top_k > topk_groups * (num_experts // num_groups):
            raise ValueError(f"topk_groups={topk_groups} must be in [1, num_groups={num_groups}] and its groups "
                             f"must hold at least top_k={top_k} experts")
        self.num_experts, self.top_k, self.renormalize, self.scale = num_experts, top_k, renormalize, scale
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.expert_bias: torch.Tensor
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))

    def reset_buffers(self) -> None:
        """Balanced from the start: a model built on meta and allocated with ``to_empty`` would
        otherwise route by whatever the new memory held (a loaded checkpoint overwrites this)."""
        with torch.no_grad():
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> Routing:
        logits = router_logits(x, self.weight)
        scores = torch.sigmoid(logits)
        biased = scores + self.expert_bias.float()
        if self.num_groups > 1:
            biased = self._mask_groups(biased)
        experts = torch.topk(biased, self.top_k, dim=-1).indices
        top = scores.gather(-1, experts)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        probs = scores / scores.sum(dim=-1, keepdim=True)
        return Routing(weights=top * self.scale, experts=experts, logits=logits, probs=probs)

    def _mask_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """Scores outside each token's ``topk_groups`` best groups set to ``-inf``."""
        t = biased.shape[0]
        grouped = biased.view(t, self.num_groups, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_groups, dim=-1).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, -1)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, groups={self.num_groups}, "
                f"topk_groups={self.topk_groups}, scale={self.scale}")


def sigmoid_router_from(router: nn.Module, *, num_groups: int = 1, topk_groups: int = 1) -> SigmoidTopKRouter:
    """A :class:`SigmoidTopKRouter` over ``router``'s weight (the same parameter, so loaded weights
    and optimizer entries carry over) with its expert count, top-k and renormalisation, and a zero
    bias: how a recipe turns a family's softmax router into a sigmoid one."""
    weight = router.weight
    top_k = router.top_k
    assert isinstance(weight, nn.Parameter) and isinstance(top_k, int), "a router has weight [E, H] and top_k"
    new = SigmoidTopKRouter(weight.shape[1], weight.shape[0], top_k,
                            renormalize=bool(getattr(router, "renormalize", True)), num_groups=num_groups,
                            topk_groups=topk_groups, device=weight.device, dtype=weight.dtype)
    new.weight = weight
    return new


@torch.no_grad()
def update_expert_bias(router: SigmoidTopKRouter, tokens_per_expert: torch.Tensor, rate: float,
                       enabled: torch.Tensor | None = None) -> None:
    """One auxiliary-loss-free balancing update, after an optimizer step: raise the bias of
    under-loaded experts and lower it for over-loaded ones by ``rate`` (the sign of the load
    error, so the step size does not depend on the batch size). ``tokens_per_expert`` ``[E]`` is the
    step's load summed over micro-batches and data-parallel ranks (the same on every rank, so the
    biases stay identical). ``enabled`` (a device bool) can cancel the update without a host read
    (a skipped step). Stays on the device."""
    load = tokens_per_expert.float()
    delta = rate * torch.sign(load.mean() - load)
    router.expert_bias.add_(delta if enabled is None else delta * enabled)
