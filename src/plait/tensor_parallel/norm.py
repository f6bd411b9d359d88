"""RMSNorm for sequence-parallel regions.

Under sequence parallelism each TP rank normalises its own sequence shard with the same
(replicated) weight, so the weight gradient computed on one rank covers only its tokens; the
gradient is summed over the TP group in backward to equal the unsharded one.
"""

from __future__ import annotations

import torch

from plait.comm import collectives as C
from plait.comm.primitives import GroupInfo
from plait.models.llama.model import RMSNorm, rms_norm


class SequenceParallelRMSNorm(RMSNorm):
    def __init__(self, hidden_size: int, eps: float, tp: GroupInfo, device=None, dtype=None) -> None:
        super().__init__(hidden_size, eps, device=device, dtype=dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, C.all_reduce_grad(self.weight, self.tp.group), self.eps)
