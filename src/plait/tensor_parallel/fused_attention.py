"""Tensor-parallel self-attention with one fused q/k/v projection, sharded by whole heads.

The unsharded layer (``query_key_value``, ``dense``: Hugging Face's names in GPT-NeoX) projects
the input once into ``heads * 3 * head_dim`` features laid out head by head, ``[q, k, v]`` of
``head_dim`` each per head (:func:`plait.nn.attention.split_fused_heads`). Cutting those rows in
``tp`` contiguous pieces would hand a rank the q of some heads and the k of others; here each
rank holds the rows of its own heads with all three parts (:meth:`HeadLayout.grouped_rows`), so
its q, k and v belong to the same heads and attention needs no communication. ``dense`` is
row-parallel over the same heads (its bias replicated, added once after the reduction).

There is no grouped-query attention (one K/V head per query head), hence no KV replication. When
``tp`` does not divide the heads, padding heads (zero rows, zero bias) are added as in
:class:`~plait.tensor_parallel.attention.ParallelSelfAttention`, and their attention output is
masked to zero before ``dense``, so an adapter or an optimizer step can never make them count.

The weight-free middle (rotary, SDPA, attention dropout from the per-rank stream) is the submodule
``core``, a :class:`~plait.tensor_parallel.attention.ParallelAttentionCore`, as in the unfused layer.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.nn.attention import split_fused_heads
from plait.tensor_parallel.attention import AttentionFn, ParallelAttentionCore
from plait.tensor_parallel.heads import HeadLayout
from plait.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from plait.tensor_parallel.random import TensorParallelRNG


class ParallelFusedSelfAttention(nn.Module):
    """``dense(core(split(query_key_value(x))))`` on this rank's heads (see the module doc).

    ``forward(x, cos, sin, mask=None)``: ``x`` is ``[batch, seq, hidden]`` (a sequence shard under
    sequence parallelism, gathered by ``query_key_value`` and scattered again by ``dense``); the
    rotary tables may be narrower than ``head_dim`` (partial rotary).
    """

    #: its forward calls each projection as a module (no fused matmul of several weights), so a LoRA
    #: adapter on one adds itself in that projection's own forward (see :mod:`plait.lora.apply`)
    calls_its_projections: ClassVar[bool] = True
    #: zero on the padding heads' output features, ``None`` when this rank holds no padding head
    head_mask: torch.Tensor | None

    def __init__(self, hidden_size: int, layout: HeadLayout, tp: GroupInfo, attention_fn: AttentionFn, *,
                 bias: bool = True, sequence_parallel: bool = False, attention_dropout: float = 0.0,
                 rng: TensorParallelRNG | None = None, device=None, dtype=None) -> None:
        super().__init__()
        self.layout, self.tp = layout, tp
        self.sequence_parallel = sequence_parallel
        hd, r, n = layout.head_dim, tp.rank, layout.num_heads
        kw = {"bias": bias, "sequence_parallel": sequence_parallel, "device": device, "dtype": dtype}
        self.query_key_value = ColumnParallelLinear(hidden_size, 3 * n * hd, tp, rows=layout.grouped_rows(r, 3), **kw)
        self.dense = RowParallelLinear(n * hd, hidden_size, tp, cols=layout.q_rows(r), **kw)
        self.core = ParallelAttentionCore(attention_fn, attention_dropout, rng)
        mask = self._mask()
        self.register_buffer("head_mask", None if bool(mask.all()) else mask.to(device), persistent=False)

    def _mask(self) -> torch.Tensor:
        real = torch.tensor(self.layout.real_q_mask(self.tp.rank), dtype=torch.float32)
        return real.repeat_interleave(self.layout.head_dim)

    def reset_buffers(self) -> None:
        """Rebuild the padding mask (after materialising from the meta device)."""
        if self.head_mask is not None:
            self.head_mask = self._mask().to(self.head_mask.device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = split_fused_heads(self.query_key_value(x), self.layout.head_dim)
        out = self.core(q, k, v, cos, sin, mask)
        if self.head_mask is not None:
            out = out * self.head_mask.to(out.dtype)
        return self.dense(out)

    def extra_repr(self) -> str:
        lay = self.layout
        return f"heads={lay.num_heads}->{lay.padded_num_heads} (local {lay.local_q_heads}), fused q/k/v per head"


__all__ = ["ParallelFusedSelfAttention"]
