"""Build a model for one rank: on the meta device, parallelized, then only the local shard allocated.

The whole model is described on the meta device (no memory), the tensor-parallel plan swaps in
parallel modules (still on meta), and only then is this rank's shard allocated on the target
device and filled, either with the layout-invariant initial values or from a checkpoint.

Every built model (and stage) carries ``rng_tracker``, the per-TP-rank random stream for dropout
on sharded activations (:class:`~plait.tensor_parallel.random.TensorParallelRNG`), seeded from
``rng_seed`` (default: the build ``seed``) and the TP rank. The global generator, used for
dropout on replicated activations, is left to the caller, who must seed it identically on the
ranks of a TP group.
"""

from __future__ import annotations

import torch

from plait.init import init_parameters
from plait.mesh import ParallelMesh
from plait.models.llama.config import LlamaConfig
from plait.models.llama.model import LlamaForCausalLM
from plait.models.llama.parallelize import parallelize, reset_buffers
from plait.tensor_parallel.random import TensorParallelRNG


def build_llama(config: LlamaConfig, mesh: ParallelMesh, *, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                init: bool = True, rng_seed: int | None = None) -> LlamaForCausalLM:
    """This rank's Llama shard on ``device``; weights initialised from ``seed`` unless ``init=False``.

    ``rng_seed`` seeds ``model.rng_tracker`` (default ``seed``).
    """
    rng = TensorParallelRNG(seed if rng_seed is None else rng_seed, mesh.tp_rank)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=dtype)
    if mesh.tp > 1:
        parallelize(model, mesh, sequence_parallel=sequence_parallel, rng=rng)
    model.rng_tracker = rng  # also without TP, so every built model has one
    model.to_empty(device=device)
    model.tie_weights()
    reset_buffers(model)
    if init:
        init_parameters(model, seed, config.initializer_range)
    return model


def build_llama_stages(config: LlamaConfig, mesh: ParallelMesh, stage_layers: list[list[int]], *, seed: int = 0,
                       device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       sequence_parallel: bool = False, init: bool = True,
                       rng_seed: int | None = None) -> list[torch.nn.Module]:
    """This rank's pipeline stages (its virtual chunks, in chunk order), each allocated alone.

    ``stage_layers[s]`` lists the decoder layers of global stage ``s`` (``len == pp * vpp``); rank
    ``r`` holds stages ``r, r + pp, ...`` (chunk ``c`` is stage ``c * pp + r``). The full model is
    only ever described on the meta device: nothing outside this rank's stages is allocated.
    The stages share one ``rng_tracker`` seeded from ``rng_seed`` (default ``seed``) and the TP
    rank; pass a ``rng_seed`` that depends on the pipeline rank for streams that also differ
    between pipeline ranks.
    """
    from plait.models.llama.pipeline_stage import LlamaStage

    num_stages = len(stage_layers)
    rng = TensorParallelRNG(seed if rng_seed is None else rng_seed, mesh.tp_rank)
    with torch.device("meta"):
        full = LlamaForCausalLM(config, dtype=dtype)
    if mesh.tp > 1:
        parallelize(full, mesh, sequence_parallel=sequence_parallel, rng=rng)
    full.rng_tracker = rng
    stages = []
    for s in range(mesh.pp_rank, num_stages, mesh.pp):
        stage = LlamaStage(full, stage_layers[s], first=s == 0, last=s == num_stages - 1)
        stage.to_empty(device=device)
        stage.tie_weights()
        reset_buffers(stage)
        if init:
            init_parameters(stage, seed, config.initializer_range)
        stages.append(stage)
    return stages
