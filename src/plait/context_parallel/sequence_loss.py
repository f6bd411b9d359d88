"""The language-model loss under context parallelism.

A rank holds two chunks of each row, so its last token of a chunk predicts a token that another
rank holds. The batch split therefore shifts the labels on the *whole* row first
(:func:`plait.context_parallel.batch.split_token_batch`): here ``labels`` are already the targets
of this rank's positions and are not shifted again.

The loss a rank returns is the loss of the whole micro-batch, the same on every cp rank: the sum of
the token losses is all-reduced over the cp group (and divided by ``loss_normalizer``, or by the
all-reduced count of target tokens). So the pipeline runtime, the logged loss and evaluation see
exactly what one rank holding the whole sequence would. In backward the all-reduce passes each rank
the gradient of its own tokens times ``cp``: the data-parallel reduction then averages parameter
gradients over the dp x cp ranks, and the sum over cp of the partial gradients, divided by ``cp``
again, is the whole sequence's gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.comm import collectives as C
from plait.comm.primitives import GroupInfo, all_reduce
from plait.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


class _SumOverContext(torch.autograd.Function):
    """Forward: sum over the cp group. Backward: this rank's gradient times the group size."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
        ctx.size = info.size
        out = x.clone()
        all_reduce(out, info.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.size, None


class ContextParallelOutput(nn.Module):
    """Replaces a causal-LM output module (plain or vocab-parallel) when ``cp > 1``."""

    def __init__(self, vocab_size: int, tp: GroupInfo, cp: GroupInfo, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size, self.tp, self.cp, self.ignore_index = vocab_size, tp, cp, ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None,
                loss_normalizer: float | None = None) -> torch.Tensor:
        """``labels``: this rank's *targets* (shifted before the split). Returns the micro-batch's loss
        (as :class:`plait.nn.lm_output.CausalLMOutput`), or without labels this rank's logits."""
        if labels is None:
            full = C.gather_from_tp(logits, -1, self.tp.group) if self.tp.size > 1 else logits
            return full[..., : self.vocab_size]
        targets = labels.reshape(-1)
        per_token = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets,
                                                 self.vocab_size, self.tp, self.ignore_index)
        total = _SumOverContext.apply(per_token.sum(), self.cp)
        assert isinstance(total, torch.Tensor)
        if loss_normalizer is not None:
            return total / loss_normalizer
        count = (targets != self.ignore_index).sum().to(total.dtype)
        if self.cp.size > 1:
            dist.all_reduce(count, group=self.cp.group)
        return total / count.clamp(min=1)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, tp={self.tp.size}, cp={self.cp.size}, labels pre-shifted"
