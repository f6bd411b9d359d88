"""Cross-entropy over vocabulary-sharded logits that never gathers the full logits.

Each rank holds logits for a block of the vocabulary. The loss needs only three reductions over
the TP group, each of one number per token: the maximum logit (for stability), the sum of
exponentials, and the logit of the target token (held by exactly one rank). Backward is local:
``softmax - onehot`` on the rank's own block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.comm.primitives import GroupInfo


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, ignore_index):
        # logits: [N, V_local] (any float dtype; computed in fp32); target: [N] global ids.
        x = logits.float()
        v_local = x.shape[-1]
        real = vocab_size - vocab_start
        if real < v_local:  # padding columns of the last block never win and carry no mass
            x = x.clone()
            x[:, max(real, 0):] = float("-inf")
        row_max = x.max(dim=-1).values
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)
        local_t = target - vocab_start
        ignored = target == ignore_index
        mine = (local_t >= 0) & (local_t < v_local) & ~ignored
        safe_t = local_t.clamp(0, v_local - 1)
        target_logit = x.gather(1, safe_t.unsqueeze(1)).squeeze(1) * mine
        exp = x.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe_t, mine, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_t, mine, ignored = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe_t] -= mine.to(grad.dtype)
        grad.mul_((grad_loss * ~ignored).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                 tp: GroupInfo, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss ``[N]`` (0 where ignored) from local logits ``[N, V_local]``.

    ``vocab_size`` is the real vocabulary; columns past it (TP padding) are excluded.
    """
    v_local = logits.shape[-1]
    vocab_start = tp.rank * v_local
    group = tp.group if tp.size > 1 else None
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group, ignore_index)
