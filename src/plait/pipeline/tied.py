"""Keeps an embedding tied across the first and last pipeline stage identical.

Both ends hold their own copy of the weight (initialised identically from its one name). After
backward, the two gradients (the lookup's on the first stage, the output head's on the last) are
summed over the two ranks, so both copies receive the full gradient and take identical steps.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from plait.mesh import ParallelMesh


def tied_weight(stage: nn.Module):
    if not stage.config.tie_word_embeddings or not (stage.first or stage.last):
        return None
    return stage.model.embed_tokens.weight


def sync_tied_gradients(stages: list[nn.Module], mesh: ParallelMesh) -> None:
    if mesh.pp == 1:
        return
    ends = [w for w in (tied_weight(s) for s in stages) if w is not None and w.grad is not None]
    if not ends:
        return
    group = mesh.group("tied")
    for w in ends:
        dist.all_reduce(w.grad, group=group)
