"""Tensor-parallel grouped-query self-attention with KV replication and head padding.

Each rank holds the query heads and K/V heads named by a :class:`HeadLayout`. The q/k/v
projections share one gathered input and one input-gradient reduction (see
:mod:`plait.tensor_parallel.column_matmul`). With KV replication factor ``m > 1``:

* replicas of a K/V head start identical (they are cut from the same full weight);
* the K/V output gradients are summed over the KV-shared group, so every replica computes the
  full weight gradient of its heads and replicas stay identical after any optimizer step;
* the K/V share of the input gradient is divided by ``m``: it is computed identically on all
  ``m`` replicas and then summed over the TP group, which would count it ``m`` times.

Padding heads (zero weights) have their attention output masked to zero before ``o_proj``.

With ``qk_norm_eps`` set, q and k pass through per-head RMSNorms (``q_norm``/``k_norm``, weights
replicated, gradients summed over the TP group: :class:`ParallelHeadRMSNorm`, or with
``qk_norm_offset`` the ``1 + weight`` form) before rotary. ``query_scale`` multiplies the queries
before the core (a softmax scale other than ``head_dim ** -0.5``, see
:func:`plait.nn.attention.query_scale_for`).

Attention dropout acts on this rank's heads only, so its mask must differ between TP ranks: it is
drawn inside ``rng.fork()`` from the per-rank :class:`~plait.tensor_parallel.random.TensorParallelRNG`
stream. The weight-free middle (rotary, SDPA, dropout) is the submodule ``core``, which selective
activation checkpointing can name (``self_attn.core``); it has no parameters, so names are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.comm import collectives as C
from plait.comm.primitives import GroupInfo
from plait.tensor_parallel.column_matmul import column_parallel_matmul
from plait.tensor_parallel.heads import HeadLayout
from plait.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from plait.tensor_parallel.norm import ParallelHeadOffsetRMSNorm, ParallelHeadRMSNorm
from plait.tensor_parallel.random import TensorParallelRNG

#: ``fn(q, k, v, cos, sin)`` on ``[batch, seq, local_heads*head_dim]`` projections; when attention
#: dropout is on it is called with ``dropout_p=`` as well
AttentionFn = Callable[..., torch.Tensor]


class ParallelAttentionCore(nn.Module):
    """Calls ``attention_fn`` on the local heads, with attention dropout drawn from the per-rank stream.

    Dropout is requested only in training mode with ``dropout > 0``; otherwise ``attention_fn`` is
    called without ``dropout_p``, so functions that do not take it keep working. While a decoding
    engine generates (:mod:`plait.inference`), ``kv_cache`` attends the local heads' new positions
    over their cached keys instead.
    """

    #: ``fn(q, k, v, cos, sin)`` over the local heads' cached keys while generating, else ``None``
    kv_cache: Callable[..., torch.Tensor] | None

    def __init__(self, attention_fn: AttentionFn, dropout: float = 0.0, rng: TensorParallelRNG | None = None) -> None:
        super().__init__()
        if dropout and rng is None:
            raise ValueError(f"attention_dropout={dropout} needs an rng (a TensorParallelRNG): each TP rank holds "
                             f"different heads and must draw its own dropout mask")
        self.attention_fn, self.dropout, self.rng = attention_fn, dropout, rng
        self.kv_cache = None
        #: the sliding window ``attention_fn`` was bound to (``functools.partial(..., window=w)``), which
        #: a decoding engine's cache of this layer keeps; ``None``: full attention
        self.window: int | None = getattr(attention_fn, "keywords", {}).get("window")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.kv_cache is not None:
            assert mask is None, "a cached forward builds its own mask (packed rows are not generated)"
            return self.kv_cache(q, k, v, cos, sin)
        kw = {} if mask is None else {"mask": mask}  # functions that know no packed batches keep working
        if not (self.training and self.dropout > 0):
            return self.attention_fn(q, k, v, cos, sin, **kw)
        rng = self.rng
        assert rng is not None, "the constructor refuses dropout without an rng"
        with rng.fork(q.device):
            return self.attention_fn(q, k, v, cos, sin, dropout_p=self.dropout, **kw)

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}"


class ParallelSelfAttention(nn.Module):
    #: zero on the padding heads' output features, ``None`` when this rank holds no padding head
    head_mask: torch.Tensor | None

    def __init__(self, hidden_size: int, layout: HeadLayout, tp: GroupInfo, kv: GroupInfo,
                 attention_fn: AttentionFn, *, qkv_bias: bool = False, o_bias: bool = False,
                 sequence_parallel: bool = False,
                 attention_dropout: float = 0.0, rng: TensorParallelRNG | None = None,
                 qk_norm_eps: float | None = None, qk_norm_offset: bool = False, query_scale: float = 1.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.layout, self.tp, self.kv, self.attention_fn = layout, tp, kv, attention_fn
        self.sequence_parallel = sequence_parallel
        self.attention_dropout = attention_dropout
        hd, r = layout.head_dim, tp.rank
        kw = {"bias": qkv_bias, "device": device, "dtype": dtype}
        self.q_proj = ColumnParallelLinear(hidden_size, layout.num_heads * hd, tp, rows=layout.q_rows(r), **kw)
        kv_kw = dict(rows=layout.kv_rows(r), replicas=layout.kv_replication, **kw)
        self.k_proj = ColumnParallelLinear(hidden_size, layout.num_kv_heads * hd, tp, **kv_kw)
        self.v_proj = ColumnParallelLinear(hidden_size, layout.num_kv_heads * hd, tp, **kv_kw)
        self.o_proj = RowParallelLinear(layout.num_heads * hd, hidden_size, tp, cols=layout.q_rows(r), bias=o_bias,
                                        sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        if qk_norm_eps is not None:  # per-head norms on q and k before rotary (Qwen3)
            norm = ParallelHeadOffsetRMSNorm if qk_norm_offset else ParallelHeadRMSNorm
            self.q_norm = norm(hd, qk_norm_eps, tp, device=device, dtype=dtype)
            self.k_norm = norm(hd, qk_norm_eps, tp, device=device, dtype=dtype)
        self.qk_norm = qk_norm_eps is not None
        self.query_scale = query_scale
        mask = torch.tensor(layout.real_q_mask(r), dtype=torch.float32).repeat_interleave(hd)
        self.register_buffer("head_mask", None if bool(mask.all()) else mask.to(device), persistent=False)
        self._kv_scale = 1.0 / layout.kv_replication
        self.core = ParallelAttentionCore(attention_fn, attention_dropout, rng)

    def reset_buffers(self) -> None:
        """Rebuild the padding mask (after materialising from the meta device)."""
        if self.head_mask is not None:
            mask = torch.tensor(self.layout.real_q_mask(self.tp.rank), dtype=torch.float32)
            self.head_mask = mask.repeat_interleave(self.layout.head_dim).to(self.head_mask.device)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = column_parallel_matmul(
            x, [m.weight for m in p], [m.bias for m in p], self.tp.group,
            sequence_parallel=self.sequence_parallel, input_grad_scales=(1.0, self._kv_scale, self._kv_scale),
            weight_grad_queue=self.q_proj.weight_grad_queue)
        if self.layout.kv_replication > 1:
            k = C.all_reduce_grad(k, self.kv.group)
            v = C.all_reduce_grad(v, self.kv.group)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        out = self.core(q, k, v, cos, sin, mask)
        if self.head_mask is not None:
            out = out * self.head_mask.to(out.dtype)
        return self.o_proj(out)

    def extra_repr(self) -> str:
        lay = self.layout
        return (f"heads={lay.num_heads}->{lay.padded_num_heads} (local {lay.local_q_heads}), "
                f"kv_heads={lay.num_kv_heads} (local {lay.local_kv_heads}), kv_replication={lay.kv_replication}")
