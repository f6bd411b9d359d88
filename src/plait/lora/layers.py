"""The LoRA adapter of one projection, on a plain or a tensor-parallel linear layer.

An adapter adds ``delta = scale * B A dropout(x)`` to its projection's output; ``A`` is ``[r, in]``,
``B`` is ``[out, r]``, both in the adapter's own dtype (fp32 by default, whatever the base dtype;
``delta`` is cast to the base output's dtype). How ``A`` and ``B`` are split over the TP group
follows the base weight, so the adapter needs no communication of its own beyond rank-``r`` tensors:

* column-parallel base (q/k/v/gate/up; output rows sharded): ``B`` holds the same rows as the base
  weight (padding rows zero, K/V rows replicated over the KV-shared group), ``A`` is replicated.
  ``u = A x`` is computed on the input this rank has; without sequence parallelism that is the
  full (replicated) input and ``u``'s gradient, a partial sum over the rows of ``B`` this rank
  holds, is summed over TP (``copy_to_tp``). Under sequence parallelism ``x`` is this rank's
  sequence chunk: ``u`` (``r`` features instead of ``hidden``) is all-gathered along the sequence,
  which replaces a second gather of ``x`` (the base layer gathers ``x`` inside its fused matmul);
  ``A``'s gradient, then a per-chunk partial sum, is summed over TP. With KV replication ``m``, a
  K/V head's rows of ``B`` live on ``m`` ranks: ``delta``'s gradient is summed over the KV-shared
  group (as the base K/V outputs' are), so the replicas of ``B`` get equal, full gradients, and
  ``u``'s gradient is scaled by ``1/m`` before the TP sum, so each K/V head counts once.
* row-parallel base (o/down; input columns sharded): ``A`` holds the base weight's columns,
  ``B`` is replicated. ``u``'s partial sums are all-reduced over TP (reduce-scattered along the
  sequence under sequence parallelism, where ``B``'s gradient is then summed over TP).
* plain ``nn.Linear`` (the unsharded model): no communication.

Dropout on the adapter input: a replicated input (column-parallel without sequence parallelism,
and the plain model) draws from the global generator, equal on every TP rank; a sharded input
(row-parallel, or a sequence chunk) draws from the model's per-rank
:class:`~plait.tensor_parallel.random.TensorParallelRNG`.

The module classes below are the base classes with the adapter added to their forward; apply
and merge (:mod:`plait.lora.apply`) swap an instance's class to and from them, so parameter
names, shard specs and activation checkpointing's wrapping of the base modules are unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from plait.comm import collectives as C
from plait.comm.primitives import GroupInfo
from plait.lora.settings import LoraSettings
from plait.tensor_parallel.attention import ParallelSelfAttention
from plait.tensor_parallel.column_matmul import column_parallel_matmul
from plait.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from plait.tensor_parallel.mlp import ParallelGatedMLP
from plait.tensor_parallel.random import TensorParallelRNG
from plait.tensor_parallel.sharding import ShardSpec

AdapterKind = Literal["plain", "column", "row"]


class LoraAdapter(nn.Module):
    """``scale * B A dropout(x)`` for one projection; parameters ``A`` (``[r, in]``) and ``B`` (``[out, r]``).

    Args:
        kind: the base layer's parallelism (see the module doc).
        a_spec / b_spec: the slice of the full ``A`` / ``B`` this rank holds (``None``: replicated).
        tp: the tensor-parallel group (single for ``plain``).
        sequence_parallel: whether the base layer's activations outside it are sequence chunks.
        kv: the KV-shared group of a replicated K/V projection, with its size ``kv_replication``.
        rng: the per-TP-rank stream for dropout on a sharded input (needed when ``dropout > 0``).
    """

    def __init__(self, kind: AdapterKind, a_spec: ShardSpec | None, b_spec: ShardSpec | None, a_shape: tuple[int, int],
                 b_shape: tuple[int, int], *, scale: float, dropout: float, tp: GroupInfo,
                 sequence_parallel: bool = False, seq_dim: int = 1, kv: GroupInfo | None = None,
                 kv_replication: int = 1, rng: TensorParallelRNG | None = None,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.kind, self.scale, self.dropout = kind, scale, dropout
        self.tp, self.sequence_parallel, self.seq_dim = tp, sequence_parallel, seq_dim
        self.kv, self.kv_replication, self.rng = kv, kv_replication, rng
        self.a_spec, self.b_spec = a_spec, b_spec
        #: the settings this adapter was built from (set by ``apply_lora``; written to PEFT's config)
        self.settings: LoraSettings | None = None
        #: False while :func:`plait.lora.adapters_disabled` holds: the projection is its base alone
        self.enabled = True
        local_a = a_spec.local_shape if a_spec is not None else a_shape
        local_b = b_spec.local_shape if b_spec is not None else b_shape
        self.A = nn.Parameter(torch.empty(local_a, device=device, dtype=dtype))
        self.B = nn.Parameter(torch.empty(local_b, device=device, dtype=dtype))

    @property
    def full_a_shape(self) -> tuple[int, ...]:
        return self.a_spec.full_shape if self.a_spec is not None else tuple(self.A.shape)

    @property
    def full_b_shape(self) -> tuple[int, ...]:
        return self.b_spec.full_shape if self.b_spec is not None else tuple(self.B.shape)

    def shard_specs(self) -> dict[str, ShardSpec]:
        """The sharded adapter weights (read by :func:`plait.parallel_state.shard_specs`)."""
        specs = {}
        if self.a_spec is not None:
            specs["A"] = self.a_spec
        if self.b_spec is not None:
            specs["B"] = self.b_spec
        return specs

    @torch.no_grad()
    def reset_parameters(self, seed_of_a: int) -> None:
        """``A`` ~ U(-1/sqrt(in), 1/sqrt(in)) drawn over the FULL shape from ``seed_of_a`` and then cut
        to this rank's slice (PEFT's Kaiming-uniform bound; the same start under every layout);
        ``B`` = 0, so the adapted model starts as the base model."""
        shape = self.full_a_shape
        gen = torch.Generator().manual_seed(seed_of_a)
        bound = 1.0 / shape[1] ** 0.5
        full = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        self.A.copy_(self.a_spec.shard(full) if self.a_spec is not None else full)
        self.B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``delta`` for the base layer's input ``x``, in the adapter's dtype (the caller casts)."""
        h = self._drop(x.to(self.A.dtype))
        group = self.tp.group
        if self.kind == "column":
            a = C.all_reduce_grad(self.A, group) if self.sequence_parallel else self.A
            u = F.linear(h, a)
            u = C.gather_from_sp(u, self.seq_dim, group) if self.sequence_parallel else C.copy_to_tp(u, group)
            u = C.scale_grad(u, 1.0 / self.kv_replication)
            delta = F.linear(u, self.B) * self.scale
            if self.kv is not None and self.kv_replication > 1:
                delta = C.all_reduce_grad(delta, self.kv.group)
            return delta
        if self.kind == "row":
            u = F.linear(h, self.A)
            if self.sequence_parallel:
                u = C.reduce_scatter_to_sp(u, self.seq_dim, group)
                b = C.all_reduce_grad(self.B, group)
            else:
                u, b = C.reduce_from_tp(u, group), self.B
            return F.linear(u, b) * self.scale
        return F.linear(F.linear(h, self.A), self.B) * self.scale

    def _drop(self, h: torch.Tensor) -> torch.Tensor:
        # skipped at p == 0 or in eval mode, so no generator advances for nothing
        if not (self.training and self.dropout > 0):
            return h
        if self.kind == "row" or (self.kind == "column" and self.sequence_parallel):
            rng = self.rng
            assert rng is not None, "apply_lora refuses dropout on a sharded input without a TensorParallelRNG"
            with rng.fork(h.device):
                return F.dropout(h, self.dropout, True)
        return F.dropout(h, self.dropout, True)

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, A={tuple(self.A.shape)} of {self.full_a_shape}, B={tuple(self.B.shape)} of "
                f"{self.full_b_shape}, scale={self.scale:g}, dropout={self.dropout}, "
                f"kv_replication={self.kv_replication}")


def adapter_of(module: nn.Module | None) -> LoraAdapter | None:
    """The adapter a projection carries (``module.lora``), or ``None``."""
    adapter = getattr(module, "lora", None)
    return adapter if isinstance(adapter, LoraAdapter) else None


def _plus_adapter(proj: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    adapter = adapter_of(proj)
    return y if adapter is None or not adapter.enabled else y + adapter(x).to(y.dtype)


class LoraLinear(nn.Linear):
    """``nn.Linear`` plus its adapter (the unsharded model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _plus_adapter(self, x, super().forward(x))


class LoraColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` plus its adapter, when called on its own (attention and the MLP call
    the fused matmul instead and add the adapters themselves)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _plus_adapter(self, x, super().forward(x))


class LoraRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` plus its adapter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _plus_adapter(self, x, super().forward(x))


class LoraParallelSelfAttention(ParallelSelfAttention):
    """Parallel attention whose fused q/k/v projection adds each projection's adapter.

    The adapters' K/V deltas carry their own gradient sum over the KV-shared group, so adding
    them after the base projection's sum is the same as adding them before it.
    """

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(x)
        return (_plus_adapter(self.q_proj, x, q), _plus_adapter(self.k_proj, x, k),
                _plus_adapter(self.v_proj, x, v))


class LoraParallelGatedMLP(ParallelGatedMLP):
    """Parallel SwiGLU MLP whose fused gate/up projection adds each projection's adapter
    (``down_proj`` is a :class:`LoraRowParallelLinear` when adapted)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_parallel_matmul(
            x, [self.gate_proj.weight, self.up_proj.weight], [self.gate_proj.bias, self.up_proj.bias],
            self.tp.group, sequence_parallel=self.sequence_parallel)
        gate, up = _plus_adapter(self.gate_proj, x, gate), _plus_adapter(self.up_proj, x, up)
        return self.down_proj(self.act(gate, up))


#: base class -> the class with adapters; apply swaps an instance's class forward, merge back
LORA_CLASS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: LoraLinear,
    ColumnParallelLinear: LoraColumnParallelLinear,
    RowParallelLinear: LoraRowParallelLinear,
    ParallelSelfAttention: LoraParallelSelfAttention,
    ParallelGatedMLP: LoraParallelGatedMLP,
}
BASE_CLASS: dict[type[nn.Module], type[nn.Module]] = {lora: base for base, lora in LORA_CLASS.items()}
