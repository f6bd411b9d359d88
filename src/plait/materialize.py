"""Build a model for one rank: on the meta device, parallelized, then only the local shard allocated.

The whole model is described on the meta device (no memory), the tensor-parallel plan swaps in
parallel modules (still on meta), and only then is this rank's shard allocated on the target
device and filled, either with the layout-invariant initial values or from a checkpoint.
"""

from __future__ import annotations

import torch

from plait.init import init_parameters
from plait.mesh import ParallelMesh
from plait.models.llama.config import LlamaConfig
from plait.models.llama.model import LlamaForCausalLM
from plait.models.llama.parallelize import parallelize, reset_buffers


def build_llama(config: LlamaConfig, mesh: ParallelMesh, *, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                init: bool = True) -> LlamaForCausalLM:
    """This rank's Llama shard on ``device``; weights initialised from ``seed`` unless ``init=False``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=dtype)
    if mesh.tp > 1:
        parallelize(model, mesh, sequence_parallel=sequence_parallel)
    model.to_empty(device=device)
    model.tie_weights()
    reset_buffers(model)
    if init:
        init_parameters(model, seed, config.initializer_range)
    return model
