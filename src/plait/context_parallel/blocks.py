"""Attention of one query chunk against one key chunk, returning the log-sum-exp, and its backward.

The ring needs, for every piece, the partial output *and* its log-sum-exp (LSE) so that pieces
computed at different steps can be merged exactly (:func:`merge`). PyTorch's public SDPA returns no
LSE, so these are written in plain PyTorch math (matmul, ``logsumexp``, ``exp``): the scores of one
piece (``[batch, kv_heads, group, n, m]``) are materialised, in fp32 whatever the input dtype, which
is what a flash kernel avoids; on an accelerator a kernel that returns the LSE would take this
file's place behind the same two functions.

Grouped-query attention is computed without expanding K/V: queries are viewed as
``[batch, kv_heads, group, n, head_dim]`` (query head ``h`` uses K/V head ``h // group``, as SDPA's
``enable_gqa``) and K/V broadcast over ``group``; the K/V gradients are summed over ``group``.

A query row that sees no key of a piece (possible with a document mask) has LSE ``-inf`` and output
zero; :func:`merge` and the backward treat such rows as contributing nothing.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows seeing nothing) replaced by 0, so ``exp(s - lse)`` gives 0 there."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, NEG_INF)


def piece_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [b, kvh, g, n, d]``, ``k/v [b, kvh, m, d]`` (fp32), ``mask`` broadcastable to
    ``[b, kvh, g, n, m]`` (True: attend) or ``None``. Returns ``(out [b, kvh, g, n, d], lse [b, kvh, g, n])``."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v.unsqueeze(2)), lse


def merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
          lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions of the same queries over disjoint key sets (fp32)."""
    new = torch.logaddexp(acc_lse, lse)
    base = _finite(new)
    a = torch.exp(acc_lse - base).unsqueeze(-1)
    b = torch.exp(lse - base).unsqueeze(-1)
    return acc_out * a + out * b, new


def piece_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one piece given the *final* ``lse`` of the queries and ``delta = rowsum(dout * out)``
    of the final output (the softmax over all keys, recomputed per piece). Shapes as
    :func:`piece_forward`; returns ``(dq [b, kvh, g, n, d], dk [b, kvh, m, d], dv [b, kvh, m, d])``."""
    s = _scores(q, k, mask, scale)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
    dp = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale
    return dq, dk, dv
