"""How a local parameter relates to its full (unsharded, Hugging Face layout) tensor.

Every sharded parameter is described by a :class:`ShardSpec`: along one dimension, the local
tensor holds the full tensor's entries at ``index`` (in order), where ``-1`` marks a padding
entry that is zero and has no counterpart in the full tensor. This one description covers
column/row sharding, vocabulary padding, attention-head padding and the Q-head permutation and
K/V replication of mixed tensor-parallel degrees, so initialisation, Hugging Face import and
export, and tests all go through the same two functions: :meth:`ShardSpec.shard` and
:func:`assemble_from_shards`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """Local = ``full.index_select(dim, index)`` with zeros where ``index == -1``.

    ``replicas`` is how many ranks of the group hold each real entry (the KV replication factor
    for K/V projections, 1 otherwise); reductions such as the global gradient norm divide by it
    so that every entry counts once.
    """

    dim: int
    index: tuple[int, ...]
    full_shape: tuple[int, ...]
    replicas: int = 1

    @staticmethod
    def contiguous(full_shape: tuple[int, ...], dim: int, start: int, length: int, pad_from: int | None = None):
        """A contiguous slice ``[start, start+length)``; entries at or past ``pad_from`` are padding."""
        limit = full_shape[dim] if pad_from is None else pad_from
        idx = tuple(i if i < limit else -1 for i in range(start, start + length))
        return ShardSpec(dim, idx, tuple(full_shape))

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = len(self.index)
        return tuple(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """The local tensor cut from ``full`` (padding entries are zero)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a full tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        idx = torch.tensor(self.index, dtype=torch.long, device=full.device)
        valid = idx >= 0
        out = full.index_select(self.dim, idx.clamp(min=0))
        if not bool(valid.all()):
            shape = [1] * full.dim()
            shape[self.dim] = len(self.index)
            out = out * valid.view(shape).to(out.dtype)
        return out

    def runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs ``(local_start, full_start, length)`` of consecutive real entries.

        Readers that can only slice contiguously (safetensors) read one run at a time.
        """
        out: list[tuple[int, int, int]] = []
        for local, full in enumerate(self.index):
            if full < 0:
                continue
            if out and out[-1][0] + out[-1][2] == local and out[-1][1] + out[-1][2] == full:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((local, full, 1))
        return out


def assemble_from_shards(specs: list[ShardSpec], locals_: list[torch.Tensor]) -> torch.Tensor:
    """Rebuild the full tensor from each rank's ``(spec, local)``; every entry must be covered."""
    spec0 = specs[0]
    full = torch.zeros(spec0.full_shape, dtype=locals_[0].dtype, device=locals_[0].device)
    covered = torch.zeros(spec0.full_shape[spec0.dim], dtype=torch.bool)
    for spec, local in zip(specs, locals_, strict=True):
        idx = torch.tensor(spec.index, dtype=torch.long)
        keep = (idx >= 0).nonzero().flatten()
        full.index_copy_(spec.dim, idx[keep].to(full.device), local.index_select(spec.dim, keep.to(local.device)))
        covered[idx[keep]] = True
    if not bool(covered.all()):
        missing = (~covered).nonzero().flatten().tolist()[:8]
        raise AssertionError(f"shards do not cover the full tensor; missing entries {missing}...")
    return full
