"""Builders the tests use under their first names: :func:`plait.materialize.build_model` and
:func:`~plait.materialize.build_stages` for a Llama-family config."""

from __future__ import annotations

import torch
from torch import nn

from plait.materialize import build_model, build_stages
from plait.mesh import ParallelMesh
from plait.models.llama.config import LlamaConfig
from plait.models.llama.model import LlamaForCausalLM


def build_llama(config: LlamaConfig, mesh: ParallelMesh, *, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                init: bool = True, rng_seed: int | None = None) -> LlamaForCausalLM:
    """This rank's model shard (:func:`build_model`)."""
    model = build_model(config, mesh, seed=seed, device=device, dtype=dtype, sequence_parallel=sequence_parallel,
                        init=init, rng_seed=rng_seed)
    assert isinstance(model, LlamaForCausalLM), "every Llama-family model derives from LlamaForCausalLM"
    return model


def build_llama_stages(config: LlamaConfig, mesh: ParallelMesh, stage_layers: list[list[int]], *, seed: int = 0,
                       device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       sequence_parallel: bool = False, init: bool = True,
                       rng_seed: int | None = None) -> list[nn.Module]:
    """This rank's pipeline stages (:func:`build_stages`)."""
    return build_stages(config, mesh, stage_layers, seed=seed, device=device, dtype=dtype,
                        sequence_parallel=sequence_parallel, init=init, rng_seed=rng_seed)
