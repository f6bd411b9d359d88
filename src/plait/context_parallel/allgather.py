"""All-gather-KV context-parallel attention (``parallel.cp_mode: allgather``), for short rings.

Forward: one all-gather of every rank's K/V block (K and V stacked, K/V heads only) over the cp
group, then the same pieces as the ring (:func:`~plait.context_parallel.plan.pieces` per owner),
merged by log-sum-exp. Backward: the K/V gradients of every block are computed locally and summed
to their owners with one reduce-scatter. It trades the ring's overlap for two collectives and
``cp`` times the K/V memory, which pays off when ``cp`` is small or links are slow per message.
"""

from __future__ import annotations

import math

import torch

from plait.comm.primitives import GroupInfo, all_gather_dim, reduce_scatter_dim
from plait.context_parallel.piecewise import backward_block, empty_accumulator, forward_block
from plait.context_parallel.plan import pieces
from plait.context_parallel.ring import backward_inputs, group_queries
from plait.context_parallel.split import SequenceSplit


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit,
                info: GroupInfo, segments: torch.Tensor | None) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        qg = group_queries(q, k.shape[1])
        blocks = all_gather_dim(torch.stack([k, v]), 0, info.group).float().chunk(split.cp, dim=0)
        acc = empty_accumulator(qg)
        for owner, kv in enumerate(blocks):
            acc = forward_block(qg, kv, pieces(split, info.rank, owner), split, segments, scale, acc)
        out, lse = acc
        ctx.save_for_backward(q, k, v, out, lse, segments)
        ctx.split, ctx.info, ctx.scale = split, info, scale
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, segments = ctx.saved_tensors
        split, info, scale = ctx.split, ctx.info, ctx.scale
        qg, dout, delta, dq = backward_inputs(q, k.shape[1], out, grad_out)
        blocks = all_gather_dim(torch.stack([k, v]), 0, info.group).float().chunk(split.cp, dim=0)
        grads = [backward_block(qg, kv, dout, lse, delta, pieces(split, info.rank, owner), split, segments, scale, dq)
                 for owner, kv in enumerate(blocks)]
        dkv = reduce_scatter_dim(torch.cat(grads, dim=0), 0, info.group)
        return dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit, info: GroupInfo,
                        segments: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`plait.context_parallel.ring.ring_attention`, over an all-gather of K/V."""
    out = AllGatherAttention.apply(q, k, v, split, info, segments)
    assert isinstance(out, torch.Tensor)
    return out
