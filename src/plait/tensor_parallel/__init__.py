"""Tensor-parallel layers (Megatron-style), KV replication and head padding."""

from plait.tensor_parallel.attention import ParallelSelfAttention
from plait.tensor_parallel.column_matmul import column_parallel_matmul
from plait.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from plait.tensor_parallel.embedding import VocabParallelEmbedding
from plait.tensor_parallel.fused_attention import ParallelFusedSelfAttention
from plait.tensor_parallel.heads import HeadLayout, HeadLayoutError
from plait.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from plait.tensor_parallel.mlp import ParallelDenseMLP, ParallelGatedMLP
from plait.tensor_parallel.norm import ParallelHeadRMSNorm, SequenceParallelLayerNorm, SequenceParallelRMSNorm
from plait.tensor_parallel.random import TensorParallelRNG, TrackedDropout
from plait.tensor_parallel.sharding import ShardSpec, assemble_from_shards
from plait.tensor_parallel.vocab_parallel_output import VocabParallelCausalLMOutput

__all__ = [
    "ColumnParallelLinear", "HeadLayout", "HeadLayoutError", "ParallelDenseMLP", "ParallelFusedSelfAttention",
    "ParallelGatedMLP", "ParallelHeadRMSNorm", "ParallelSelfAttention",
    "RowParallelLinear", "SequenceParallelLayerNorm", "SequenceParallelRMSNorm", "ShardSpec", "TensorParallelRNG",
    "TrackedDropout",
    "VocabParallelCausalLMOutput",
    "VocabParallelEmbedding", "assemble_from_shards", "column_parallel_matmul", "vocab_parallel_cross_entropy",
]
