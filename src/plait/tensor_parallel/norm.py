"""Norms whose weight (and bias) is replicated over the TP group while each rank sees different data.

Under sequence parallelism each TP rank normalises its own sequence shard with the same
(replicated) weight, so the weight gradient computed on one rank covers only its tokens; the
gradient is summed over the TP group in backward to equal the unsharded one. A layer norm's bias
is the same case (:class:`SequenceParallelLayerNorm`: weight and bias gradients both summed).

A per-head norm (Qwen3's ``q_norm``/``k_norm``) is the same case along the head dimension: each
TP rank normalises only its own heads, so its weight gradient covers only those heads and is
summed over the TP group. With KV replication a K/V head is held by several ranks, but each rank's
``k_norm`` gradient comes only from its own query heads (it is taken before the K/V gradients are
summed over the KV-shared group), so every (query head, KV head) pair is counted exactly once.
"""

from __future__ import annotations

import torch

from plait.comm import collectives as C
from plait.comm.primitives import GroupInfo
from plait.nn.norm import HeadRMSNorm, LayerNorm, RMSNorm, layer_norm


class SequenceParallelRMSNorm(RMSNorm):
    def __init__(self, hidden_size: int, eps: float, tp: GroupInfo, device=None, dtype=None) -> None:
        super().__init__(hidden_size, eps, device=device, dtype=dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, C.all_reduce_grad(self.weight, self.tp.group))


class SequenceParallelOffsetRMSNorm(SequenceParallelRMSNorm):
    """:class:`SequenceParallelRMSNorm` scaled by ``1 + weight`` (see :class:`plait.nn.norm.OffsetRMSNorm`)."""

    offset = True


class SequenceParallelLayerNorm(LayerNorm):
    """Layer norm of this rank's sequence shard; weight and bias gradients are summed over the TP group."""

    def __init__(self, hidden_size: int, eps: float, tp: GroupInfo, device=None, dtype=None) -> None:
        super().__init__(hidden_size, eps, device=device, dtype=dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.tp.group
        return layer_norm(x, C.all_reduce_grad(self.weight, group), C.all_reduce_grad(self.bias, group), self.eps)


class ParallelHeadRMSNorm(HeadRMSNorm):
    """Per-head RMSNorm on this rank's heads; the weight gradient is summed over the TP group."""

    def __init__(self, head_dim: int, eps: float, tp: GroupInfo, device=None, dtype=None) -> None:
        super().__init__(head_dim, eps, device=device, dtype=dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_heads(x, C.all_reduce_grad(self.weight, self.tp.group))


class ParallelHeadOffsetRMSNorm(ParallelHeadRMSNorm):
    """:class:`ParallelHeadRMSNorm` scaled by ``1 + weight`` (see :class:`plait.nn.norm.HeadOffsetRMSNorm`)."""

    offset = True
