"""A rank's pipeline stages seen as one causal LM, ``forward(ids) -> logits`` on every rank.

Generation (:mod:`plait.inference`) needs nothing from a model but ``model(ids, position_ids=,
logits_to_keep=)`` returning the same full-vocabulary logits on every rank. With one stage (no
pipeline parallelism) that is the stage itself. With several, the hidden states of the new
positions go through the global stages in order at every decoding step (point-to-point over the
pipeline group; each rank runs the chunks it holds, and each chunk's attention reads its own
layers' cache), and the last stage's
logits are broadcast over the pipeline group, so every rank samples the same token with its
identically seeded generator and no further communication.

Shapes are known on both ends of every transfer: ``[batch, n / tp (sequence parallel) or n,
hidden]`` for a prompt of ``n`` tokens (generation pads ``n`` to a multiple of the TP degree under
sequence parallelism), in the stages' parameter dtype.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.mesh import ParallelMesh


@runtime_checkable
class LMShapeConfig(Protocol):
    """What this wrapper reads from a stage's model config: the widths of the tensors it moves."""

    hidden_size: int
    vocab_size: int


class StagesCausalLM(nn.Module):
    """``stages``: this rank's chunks in chunk order (chunk ``c`` is global stage ``c * pp + pp_rank``)."""

    #: copied from the first stage when it has them (what generation reads for its padding)
    tensor_parallel: GroupInfo
    sequence_parallel: bool

    def __init__(self, stages: list[nn.Module], mesh: ParallelMesh) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(stages)
        self.mesh = mesh
        self.pp, self.pp_rank = mesh.pp, mesh.pp_rank
        self.num_stages = self.pp * len(stages)
        first = stages[0]
        config = first.config  # a plain attribute of every family's stage; torch types it Tensor | Module
        assert isinstance(config, LMShapeConfig), f"stage config {type(config).__name__} lacks hidden/vocab size"
        self.config: LMShapeConfig = config
        for attr in ("tensor_parallel", "sequence_parallel"):  # what generation reads for its padding
            if hasattr(first, attr):
                setattr(self, attr, getattr(first, attr))

    def _owner(self, stage: int) -> int:
        return self.mesh.my_group_ranks("pp")[stage % self.pp]

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """Logits ``[batch, n or logits_to_keep, vocab]`` on every rank; ``position_ids``
        (``[batch, n]``) go to every stage (a decoding step's positions continue the cached ones)."""
        n = input_ids.shape[1]
        kw = {"position_ids": position_ids, "logits_to_keep": logits_to_keep}
        if self.num_stages == 1:
            return self.chunks[0](input_ids, n, **kw)
        param = next(self.chunks[0].parameters())
        group = self.mesh.group("pp")
        sp = getattr(self, "sequence_parallel", False)
        local = n // self.tensor_parallel.size if sp else n
        shape = (input_ids.shape[0], local, self.config.hidden_size)
        h: torch.Tensor | None = None
        for stage in range(self.num_stages):
            if stage % self.pp != self.pp_rank:
                continue
            chunk = self.chunks[stage // self.pp]
            if stage == 0:
                x = input_ids
            else:
                x = torch.empty(shape, dtype=param.dtype, device=param.device)
                dist.recv(x, src=self._owner(stage - 1), group=group)
            h = chunk(x, n, **kw)
            if stage < self.num_stages - 1:
                dist.send(h.contiguous(), dst=self._owner(stage + 1), group=group)
        last = self._owner(self.num_stages - 1)
        kept = logits_to_keep if 0 < logits_to_keep < n else n
        if self.mesh.rank == last:
            assert h is not None, "the rank holding the last stage ran it"
            logits = h.contiguous()
        else:
            logits = torch.empty((input_ids.shape[0], kept, self.config.vocab_size), dtype=param.dtype,
                                 device=param.device)
        dist.broadcast(logits, src=last, group=group)
        return logits
