"""A rank's local queries against one K/V block, piece by piece, as the ring and the all-gather
variant both need it.

Tensors here are grouped for GQA: queries ``[b, kv_heads, group, 2n, d]`` (fp32, two local chunks),
a K/V block ``[2, b, kv_heads, 2n, d]`` (K and V stacked, the owner's two chunks; any dtype, computed
in fp32). A piece
(:class:`~plait.context_parallel.plan.Piece`) is masked causally when diagonal and, for packed rows,
by document: ``segments [b, seq_len]`` holds the document id of every token of the *whole* row
(every rank has it; it is a few bytes per token), and a query sees a key only of its own document.
"""

from __future__ import annotations

import torch

from plait.context_parallel.blocks import NEG_INF, merge, piece_backward, piece_forward
from plait.context_parallel.plan import Piece
from plait.context_parallel.split import SequenceSplit


def piece_mask(piece: Piece, split: SequenceSplit, segments: torch.Tensor | None,
               device: torch.device) -> torch.Tensor | None:
    """Boolean mask of ``piece`` broadcastable to ``[b, kvh, g, n, n]`` (``None``: attend to all)."""
    n = split.chunk_len
    mask = None
    if piece.kind == "diagonal":
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if segments is not None:
        qs = segments[:, piece.q_chunk * n:(piece.q_chunk + 1) * n]
        ks = segments[:, piece.k_chunk * n:(piece.k_chunk + 1) * n]
        same = (qs.unsqueeze(2) == ks.unsqueeze(1)).unsqueeze(1).unsqueeze(1)
        mask = same if mask is None else same & mask
    return mask


def _slot(x: torch.Tensor, slot: int, n: int) -> torch.Tensor:
    return x[..., slot * n:(slot + 1) * n, :]


def empty_accumulator(qg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output zero and LSE ``-inf``: the merge identity."""
    return torch.zeros_like(qg), torch.full(qg.shape[:-1], NEG_INF, dtype=qg.dtype, device=qg.device)


def forward_block(qg: torch.Tensor, kv: torch.Tensor, pieces: tuple[Piece, ...], split: SequenceSplit,
                  segments: torch.Tensor | None, scale: float, acc: tuple[torch.Tensor, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the pieces of this K/V block into ``acc = (out, lse)`` (whole local sequence); returns it."""
    n = split.chunk_len
    kv = kv.float()
    out, lse = acc
    for p in pieces:
        mask = piece_mask(p, split, segments, qg.device)
        o, s = piece_forward(_slot(qg, p.q_slot, n), _slot(kv[0], p.k_slot, n), _slot(kv[1], p.k_slot, n),
                             mask, scale)
        rows = slice(p.q_slot * n, (p.q_slot + 1) * n)
        out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], o, s)
    return out, lse


def backward_block(qg: torch.Tensor, kv: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                   pieces: tuple[Piece, ...], split: SequenceSplit, segments: torch.Tensor | None, scale: float,
                   dq: torch.Tensor) -> torch.Tensor:
    """Add this block's query gradient into ``dq``; return the block's fp32 ``dkv [2, b, kvh, 2n, d]``."""
    n = split.chunk_len
    kv = kv.float()
    dkv = torch.zeros_like(kv)
    for p in pieces:
        mask = piece_mask(p, split, segments, qg.device)
        rows = slice(p.q_slot * n, (p.q_slot + 1) * n)
        keys = slice(p.k_slot * n, (p.k_slot + 1) * n)
        g_q, g_k, g_v = piece_backward(_slot(qg, p.q_slot, n), kv[0][..., keys, :], kv[1][..., keys, :],
                                       dout[..., rows, :], lse[..., rows], delta[..., rows], mask, scale)
        dq[..., rows, :] += g_q
        dkv[0][..., keys, :] += g_k
        dkv[1][..., keys, :] += g_v
    return dkv
