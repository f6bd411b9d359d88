"""The weight-free middle of attention: rotary, causal (optionally sliding-window) grouped-query
SDPA and attention dropout.

Packed rows (several samples back to back in one sequence) pass a ``mask`` built once per forward
by :func:`document_causal_mask`: a query sees only earlier keys of its own sample, so no sample
attends to another, and with positions restarting at 0 in each sample (the rotary tables follow
``position_ids``) every sample computes exactly what it would alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plait.nn.rotary import apply_rotary

#: attribute of a document mask holding the segment ids it was built from
SEGMENT_IDS_ATTR = "plait_segment_ids"


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[seq, seq]`` mask: query ``i`` sees keys ``j`` with ``i - window < j <= i`` (the
    window counts the query's own position, as Mistral's ``sliding_window`` does)."""
    i = torch.arange(seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)
    return (j <= i) & (j > i - window)


def query_scale_for(head_dim: int, softmax_scale: float) -> float:
    """The factor on the queries that turns SDPA's ``head_dim ** -0.5`` softmax scale into
    ``softmax_scale`` (Gemma's ``query_pre_attn_scalar ** -0.5``). Applied to the queries before the
    attention core (rotary is linear, so before or after it is the same), the scale holds on every
    path a core takes: full or windowed SDPA, the KV cache, context parallelism."""
    return softmax_scale * head_dim ** 0.5


def document_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[batch, 1, seq, seq]`` mask of a packed batch: query ``i`` sees key ``j`` when
    ``j <= i`` and both belong to the same sample (``segment_ids [batch, seq]``; padding, any
    id of its own, attends only to padding, so no row of the mask is empty)."""
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    mask = (same & causal).unsqueeze(1)
    # Context-parallel attention needs the ids themselves: a rank's mask of its own tokens cannot tell
    # whether a document continues on another rank (see plait.context_parallel.attention).
    setattr(mask, SEGMENT_IDS_ATTR, segment_ids)
    return mask


def segment_ids_of(mask: torch.Tensor) -> torch.Tensor | None:
    """The ``segment_ids`` a :func:`document_causal_mask` was built from (``None`` for another mask)."""
    return getattr(mask, SEGMENT_IDS_ATTR, None)


def split_fused_heads(qkv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``[batch, seq, heads, head_dim]`` queries, keys and values of a fused projection laid out
    head by head, ``[q, k, v]`` of ``head_dim`` each per head (GPT-NeoX's ``query_key_value``), as
    views of ``qkv`` (``[batch, seq, heads * 3 * head_dim]``): nothing is copied."""
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, -1, 3 * head_dim).split(head_dim, dim=-1)
    return q, k, v


def _seq_major(table: torch.Tensor) -> torch.Tensor:
    """A rotary table (``[seq, d]``, or ``[batch, 1, seq, d]`` from position ids) broadcast over the
    heads of ``[batch, seq, heads, d]`` tensors."""
    return table.unsqueeze(-2) if table.dim() == 2 else table.transpose(1, 2)


def rotated_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections as ``[batch, heads, seq, head_dim]``, with the rotary embedding applied to the
    queries and keys.

    Projections are ``[batch, seq, heads*head_dim]`` (``head_dim`` read from the rotary table) or
    ``[batch, seq, heads, head_dim]``; the latter may come with a table narrower than the head
    (partial rotary: the leading dimensions of each head rotate, see
    :func:`~plait.nn.rotary.apply_rotary`).
    """
    if q.dim() == 4:
        # rotated as [batch, seq, heads, head_dim], so the new q and k keep that memory layout and
        # SDPA's output comes back in it: [batch, seq, heads*head_dim] is then a view, not a copy
        q, k = apply_rotary(q, k, _seq_major(cos), _seq_major(sin))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    b, s = q.shape[:2]
    hd = cos.shape[-1]
    q = q.view(b, s, -1, hd).transpose(1, 2)
    k = k.view(b, s, -1, hd).transpose(1, 2)
    v = v.view(b, s, -1, hd).transpose(1, 2)
    q, k = apply_rotary(q, k, cos, sin)
    return q, k, v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos, sin,
                     dropout_p: float = 0.0, window: int | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary + causal grouped-query attention on ``[batch, seq, heads*head_dim]`` projections (or
    ``[batch, seq, heads, head_dim]`` ones, see :func:`rotated_heads`).

    The head counts are read from the shapes (``head_dim`` from the rotary table, or from the
    projections when they are 4-D), so the same function serves the full model and a
    tensor-parallel shard holding a subset of the heads.
    ``dropout_p`` is SDPA's dropout on the attention weights; the caller decides (training mode,
    which generator) since this function cannot know. ``window``: each query sees at most that
    many positions (itself included); ``None`` or a window at least the sequence length is full
    causal attention and takes exactly the full-attention path. ``mask``: a packed batch's
    :func:`document_causal_mask` (the window, if any, is applied on top of it). Returns
    ``[batch, seq, q_heads*head_dim]``.
    """
    b, s = q.shape[:2]
    q, k, v = rotated_heads(q, k, v, cos, sin)
    gqa = q.shape[1] != k.shape[1]
    windowed = window is not None and window < s
    if mask is None and not windowed:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    else:
        if windowed:
            assert window is not None
            band = sliding_window_mask(s, window, q.device)
            mask = band if mask is None else mask & band
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(b, s, -1)


class AttentionCore(nn.Module):
    """Rotary + causal SDPA + attention dropout: the weight-free middle of attention.

    A module of its own (``self_attn.core``) only so selective activation checkpointing can
    recompute it; it saves the largest per-head activations and costs no matmul with weights.
    ``window`` is the sliding window (``None``: full causal attention).
    """

    #: set by :func:`plait.context_parallel.apply.apply_context_parallel`: attention over the cp group
    #: (same signature as :func:`causal_attention`); ``None``: this rank holds the whole sequence
    context_parallel: Callable[..., torch.Tensor] | None
    #: set while a decoding engine generates (:mod:`plait.inference`): ``fn(q, k, v, cos, sin)`` attends
    #: the new positions over the cached ones; ``None``: attention over the given sequence
    kv_cache: Callable[..., torch.Tensor] | None

    def __init__(self, dropout: float = 0.0, window: int | None = None) -> None:
        super().__init__()
        self.dropout = dropout
        self.window = window
        self.context_parallel = None
        self.kv_cache = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.kv_cache is not None:
            assert mask is None, "a cached forward builds its own mask (packed rows are not generated)"
            return self.kv_cache(q, k, v, cos, sin)
        if self.context_parallel is not None:
            return self.context_parallel(q, k, v, cos, sin, mask=mask)
        return causal_attention(q, k, v, cos, sin, dropout_p=self.dropout if self.training else 0.0,
                                window=self.window, mask=mask)

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}" + (f", window={self.window}" if self.window is not None else "")
