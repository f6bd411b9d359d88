"""The tensor-parallel plan of Mistral: Llama's plan with the windowed attention core.

The window acts per head on the full sequence (sequence parallelism gathers it before attention),
so it shards with the heads and needs no communication of its own.
"""

from __future__ import annotations

from functools import partial

from plait.mesh import ParallelMesh
from plait.models.llama.parallelize import parallelize as parallelize_llama
from plait.models.mistral.model import MistralForCausalLM
from plait.nn.attention import causal_attention
from plait.tensor_parallel import TensorParallelRNG


def parallelize(model: MistralForCausalLM, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                rng: TensorParallelRNG | None = None) -> MistralForCausalLM:
    """Swap in tensor-parallel modules for ``mesh``'s TP group, in place; returns the model."""
    window = model.config.sliding_window
    return parallelize_llama(model, mesh, sequence_parallel=sequence_parallel, rng=rng,
                             attention_fn=partial(causal_attention, window=window))
