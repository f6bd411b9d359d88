"""Ring attention: the executor of :func:`plait.context_parallel.plan.ring_plan` as an autograd function.

Forward: each rank starts with its own K/V block (K and V stacked in their own dtype, only the K/V
heads: grouped-query attention is never expanded before sending). At each of the ``cp`` steps it posts the transfer of
the block at hand to the next rank (and the receive of the next block from the previous one), computes
its pieces with the block while the transfer runs, and merges the partial outputs by their fp32
log-sum-exp. It keeps its queries, its own K/V, the final output and LSE for the backward.

Backward: the ring runs in reverse (blocks travel to the previous rank). Each rank recomputes the
softmax of every piece from the saved LSE, adds the query gradient locally, and adds its share of the
block's K/V gradient to an fp32 accumulator that travels one step behind the block; after the last
step one more hop returns each accumulator to the rank that owns the block. Transfers of step ``t + 1``
and of the accumulator of step ``t - 1`` overlap the computation of step ``t``.
"""

from __future__ import annotations

import math

import torch

from plait.context_parallel.exchange import RingExchange
from plait.context_parallel.piecewise import backward_block, empty_accumulator, forward_block
from plait.context_parallel.plan import ring_plan
from plait.context_parallel.split import SequenceSplit

KV_TAG, DKV_TAG = 0, 1


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, heads, s, d]`` -> fp32 ``[b, kv_heads, heads/kv_heads, s, d]`` (query head h uses K/V head h // group)."""
    b, h, s, d = q.shape
    return q.float().reshape(b, kv_heads, h // kv_heads, s, d)


def backward_inputs(q: torch.Tensor, kv_heads: int, out: torch.Tensor, grad_out: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every block's backward needs: grouped fp32 queries, the output gradient in their shape,
    ``delta = rowsum(dout * out)`` (the softmax backward term) and a zero dq accumulator."""
    qg = group_queries(q, kv_heads)
    dout = grad_out.float().reshape(qg.shape)
    delta = (dout * out).sum(-1)
    return qg, dout, delta, torch.zeros_like(qg)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit,
                exchange: RingExchange, segments: torch.Tensor | None) -> torch.Tensor:
        rank, kvh = exchange.info.rank, k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        qg = group_queries(q, kvh)
        kv = torch.stack([k, v])  # sent in the input dtype, computed in fp32
        acc = empty_accumulator(qg)
        plan = ring_plan(split, rank, direction=1)
        for step in plan:
            pending = exchange.start([kv], 1, [KV_TAG]) if step.step < split.cp - 1 else None
            acc = forward_block(qg, kv, step.pieces, split, segments, scale, acc)
            if pending is not None:
                (kv,) = pending.wait()
        out, lse = acc
        ctx.save_for_backward(q, k, v, out, lse, segments)
        ctx.split, ctx.exchange, ctx.scale = split, exchange, scale
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, segments = ctx.saved_tensors
        split, exchange, scale = ctx.split, ctx.exchange, ctx.scale
        qg, dout, delta, dq = backward_inputs(q, k.shape[1], out, grad_out)
        kv = torch.stack([k, v])  # sent in the input dtype, computed in fp32
        dkv_acc: torch.Tensor | None = None
        for step in ring_plan(split, exchange.info.rank, direction=-1):
            sends, tags = [], []
            if step.step < split.cp - 1:
                sends.append(kv)
                tags.append(KV_TAG)
            if dkv_acc is not None:
                sends.append(dkv_acc)
                tags.append(DKV_TAG)
            pending = exchange.start(sends, -1, tags) if sends else None
            dkv = backward_block(qg, kv, dout, lse, delta, step.pieces, split, segments, scale, dq)
            received = pending.wait() if pending is not None else []
            if step.step < split.cp - 1:
                kv = received.pop(0)
            if dkv_acc is not None:
                dkv = dkv + received.pop(0)
            dkv_acc = dkv
        assert dkv_acc is not None
        if split.cp > 1:  # the last hop: each accumulator back to its block's owner
            (dkv_acc,) = exchange.start([dkv_acc], -1, [DKV_TAG]).wait()
        return (dq.reshape(q.shape).to(q.dtype), dkv_acc[0].to(k.dtype), dkv_acc[1].to(v.dtype), None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, exchange: RingExchange,
                   segments: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (and, with ``segments``, document-masked) attention of this rank's local sequence.

    ``q [b, heads, 2n, d]``, ``k/v [b, kv_heads, 2n, d]``: the rank's local tokens in ``split``'s
    order (after rotary). ``segments [b, seq_len]``: document ids of the whole row, or ``None``.
    Returns ``[b, heads, 2n, d]`` in ``q``'s dtype.
    """
    out = RingAttention.apply(q, k, v, split, exchange, segments)
    assert isinstance(out, torch.Tensor)
    return out
