"""The tensor-parallel plan of Qwen3: Llama's plan with the per-head q/k norms.

The norms are replicated on every TP rank (one ``head_dim`` weight each); each rank normalises
only its own heads, so the weight gradients are summed over the TP group
(:class:`~plait.tensor_parallel.norm.ParallelHeadRMSNorm`, which also explains why K/V replicas are
not counted twice). The order of application is Llama's.
"""

from __future__ import annotations

from plait.mesh import ParallelMesh
from plait.models.llama.parallelize import parallelize as parallelize_llama
from plait.models.qwen3.model import Qwen3ForCausalLM
from plait.tensor_parallel import TensorParallelRNG


def parallelize(model: Qwen3ForCausalLM, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                rng: TensorParallelRNG | None = None) -> Qwen3ForCausalLM:
    """Swap in tensor-parallel modules for ``mesh``'s TP group, in place; returns the model."""
    return parallelize_llama(model, mesh, sequence_parallel=sequence_parallel, rng=rng, qk_norm=True)
