"""Vocabulary-parallel embedding: each TP rank holds a contiguous block of vocabulary rows.

The vocabulary is padded up to a multiple of the TP degree; padding rows are zero and never
looked up. Each rank embeds the tokens that fall in its block (zeros elsewhere) and the partial
embeddings are summed over the group, or reduce-scattered along the sequence under sequence
parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.comm import collectives as C
from plait.comm.primitives import GroupInfo
from plait.tensor_parallel.linear import even_rows
from plait.tensor_parallel.sharding import ShardSpec


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: GroupInfo, *,
                 sequence_parallel: bool = False, seq_dim: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        self.tp, self.sequence_parallel, self.seq_dim = tp, sequence_parallel, seq_dim
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        rows = even_rows(num_embeddings, tp, pad_to_multiple=True)
        self.weight_spec = ShardSpec(0, rows, (num_embeddings, embedding_dim))
        self.vocab_start = tp.rank * len(rows)
        self.weight = nn.Parameter(torch.empty(len(rows), embedding_dim, device=device, dtype=dtype))

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.weight_spec}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return C.reduce_scatter_to_sp(out, self.seq_dim, self.tp.group)
        return C.reduce_from_tp(out, self.tp.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, local_rows={self.weight.shape[0]}, "
                f"tp={self.tp.size}, sp={self.sequence_parallel}")
