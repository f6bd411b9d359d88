"""Tensor-parallel multi-head latent attention (DeepSeek-V2/V3's MLA), sharded by whole heads.

Which parts are sharded, and why:

* ``q_b_proj`` (or ``q_proj``), ``kv_b_proj``: column-parallel by heads. They hold almost all of the
  attention's weights and their outputs are per head, so each rank computes only its heads;
* ``o_proj``: row-parallel over the same heads (one reduction, as in every attention);
* the compressions ``q_a_proj`` and ``kv_a_proj_with_mqa`` and the two latent norms: **replicated**.
  Every head reads the whole latent and the shared rotary key part, so a sharded compression would
  need an all-gather of its output in every forward; replicated, it costs ``hidden * (q_lora_rank +
  kv_lora_rank + rope)`` weights per rank (about 8% of DeepSeek-V3's attention) and a repeated small
  matmul, and no communication. Under sequence parallelism the compressions run on this rank's
  sequence shard (their weight gradients summed over the TP group, :class:`ReplicatedLinear`) and the
  column-parallel expansions gather the *latent* rather than the hidden state: ``q_lora_rank`` +
  ``kv_lora_rank`` features per token instead of ``hidden`` twice.

The shared rotary key part enters the heads through the TP entry collective (copy-to-TP, or the
sequence all-gather), whose backward sums the heads' gradients. ``tp`` must divide the heads (no
padding heads: an MLA head has no K/V head to group with, so there is no replication to trade).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from plait.comm import collectives as C
from plait.comm.primitives import GroupInfo
from plait.nn.latent_attention import latent_heads
from plait.nn.norm import RMSNorm
from plait.tensor_parallel.attention import AttentionFn, ParallelAttentionCore
from plait.tensor_parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from plait.tensor_parallel.norm import SequenceParallelRMSNorm
from plait.tensor_parallel.random import TensorParallelRNG


class ParallelLatentAttention(nn.Module):
    """MLA on this rank's ``heads / tp`` heads; Hugging Face's parameter names (see the module doc).

    ``forward(x, cos, sin, mask=None)``: ``x`` ``[batch, seq, hidden]`` (a sequence shard under sequence
    parallelism); the rotary tables are ``qk_rope_head_dim`` wide.
    """

    #: each projection is called as a module, so a LoRA adapter on one adds itself in its own forward
    calls_its_projections: ClassVar[bool] = True

    def __init__(self, hidden_size: int, num_heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 nope_dim: int, rope_dim: int, v_dim: int, bias: bool, interleave: bool, query_scale: float,
                 latent_eps: float, tp: GroupInfo, attention_fn: AttentionFn, sequence_parallel: bool = False,
                 attention_dropout: float = 0.0, rng: TensorParallelRNG | None = None, device=None,
                 dtype=None) -> None:
        super().__init__()
        if num_heads % tp.size:
            raise ValueError(f"tp={tp.size} does not divide num_attention_heads={num_heads}: multi-head latent "
                             f"attention shards whole heads; choose a tp dividing {num_heads}")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank = nope_dim, rope_dim, v_dim, kv_lora_rank
        self.interleave, self.query_scale = interleave, query_scale
        sp = sequence_parallel
        kw = {"device": device, "dtype": dtype}
        qk = nope_dim + rope_dim
        norm = (lambda n: SequenceParallelRMSNorm(n, latent_eps, tp, **kw)) if sp else (
            lambda n: RMSNorm(n, latent_eps, **kw))
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * qk, tp, sequence_parallel=sp, **kw)
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, q_lora_rank, tp, bias=bias, sequence_parallel=sp, **kw)
            self.q_a_layernorm = norm(q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * qk, tp, sequence_parallel=sp, **kw)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, kv_lora_rank + rope_dim, tp, bias=bias,
                                                   sequence_parallel=sp, **kw)
        self.kv_a_layernorm = norm(kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (nope_dim + v_dim), tp, sequence_parallel=sp,
                                              **kw)
        self.o_proj = RowParallelLinear(num_heads * v_dim, hidden_size, tp, bias=bias, sequence_parallel=sp, **kw)
        self.core = ParallelAttentionCore(attention_fn, attention_dropout, rng)
        #: set while a decoding engine generates (sequence parallelism is then off): the latent cache,
        #: the same on every TP rank, attended with this rank's heads of ``kv_b_proj``
        self.latent_cache: Callable[..., torch.Tensor] | None = None

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q: torch.Tensor = self.q_proj(x)
            return q
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        group = self.tp.group
        if self.latent_cache is not None:
            assert mask is None and not self.sequence_parallel, "a cached forward is whole on every rank"
            out = self.latent_cache(self.project_q(x), self.kv_a_layernorm(latent), C.copy_to_tp(k_rope, group),
                                    self.kv_b_proj.weight, nope_dim=self.nope_dim, v_dim=self.v_dim,
                                    interleave=self.interleave, cos=cos, sin=sin,
                                    scale=self.query_scale * (self.nope_dim + self.rope_dim) ** -0.5)
            return self.o_proj(out)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        k_rope = C.gather_from_sp(k_rope, 1, group) if self.sequence_parallel else C.copy_to_tp(k_rope, group)
        q, k, v = latent_heads(self.project_q(x), kv, k_rope, nope_dim=self.nope_dim, rope_dim=self.rope_dim,
                               v_dim=self.v_dim, interleave=self.interleave)
        return self.o_proj(self.core(q * self.query_scale, k, v, cos, sin, mask))

    def extra_repr(self) -> str:
        heads = self.o_proj.weight.shape[1] // self.v_dim
        return f"local_heads={heads}, tp={self.tp.size}, sp={self.sequence_parallel}"


__all__ = ["ParallelLatentAttention"]
