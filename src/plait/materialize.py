"""Build a model for one rank: on the meta device, parallelized, then only the local shard allocated.

The whole model is described on the meta device (no memory), the family's tensor-parallel plan
swaps in parallel modules (still on meta), and only then is this rank's shard allocated on the
target device and filled, either with the layout-invariant initial values or from a Hugging Face
directory. One builder serves every model family (:mod:`plait.models.registry`; the config's
class says which) and every layout: a rank holds a list of pipeline stages, one stage with every
layer when there is no pipeline parallelism.

With expert parallelism (``mesh.ep > 1``) the experts of other expert-group ranks are removed
from the meta model (:func:`~plait.moe.expert_parallel.apply_expert_parallel`, which also installs
the token exchange) after the Hugging Face names and shapes are checked against the full model and
before anything is allocated: a rank allocates, initialises and reads only its own experts. Their
initial values are those of one process without generating the others': the initialisation
(:mod:`plait.init`) draws each parameter from a generator seeded by (seed, parameter name, block),
not from one sequential stream, and experts keep their global names (``experts.5.w1.weight``).

Every built model (and stage) carries ``rng_tracker``, the per-TP-rank random stream for dropout
on sharded activations (:class:`~plait.tensor_parallel.random.TensorParallelRNG`), seeded from
``rng_seed`` (default: the build ``seed``) and the TP rank. The global generator, used for
dropout on replicated activations, is left to the caller, who must seed it identically on the
ranks of a TP group.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from plait.deferred import DeferredValues
from plait.init import init_parameters
from plait.mesh import ParallelMesh
from plait.models.decoder.config import DecoderConfig
from plait.models.decoder.model import DecoderForCausalLM
from plait.models.hf_io import check_hf_tensors, load_hf_config, read_hf_tensors
from plait.models.registry import family_of
from plait.moe.expert_parallel import apply_expert_parallel
from plait.moe.sequence_parallel import sum_moe_gradients_over_tp
from plait.nn.buffers import reset_buffers
from plait.tensor_parallel.random import TensorParallelRNG

PathLike = str | os.PathLike


@runtime_checkable
class TiesWeights(Protocol):
    """A family's model or pipeline stage: it re-ties its output head to the embedding, which
    ``to_empty`` unties."""

    def tie_weights(self) -> None: ...


def rng_tracker_of(module: nn.Module) -> TensorParallelRNG:
    """The per-TP-rank dropout stream the builder gave ``module`` (a built model or one of its stages)."""
    tracker = module.rng_tracker
    if not isinstance(tracker, TensorParallelRNG):
        raise TypeError(f"{type(module).__name__}.rng_tracker is a {type(tracker).__name__}, "
                        f"not a TensorParallelRNG; build the model with plait.materialize")
    return tracker


def _meta_model(config: DecoderConfig, mesh: ParallelMesh, dtype: torch.dtype, sequence_parallel: bool,
                rng: TensorParallelRNG) -> DecoderForCausalLM:
    """The full model of ``config``'s family on the meta device, with its TP plan applied."""
    family = family_of(config)
    with torch.device("meta"):
        model = family.causal_lm_cls(config, dtype=dtype)
    if not isinstance(model, DecoderForCausalLM):  # every family's model derives from it
        raise TypeError(f"{family.name}: {type(model).__name__} does not derive from DecoderForCausalLM")
    if mesh.tp > 1:
        family.parallelize(model, mesh, sequence_parallel=sequence_parallel, rng=rng)
    model.rng_tracker = rng  # also without TP, so every built model has one
    return model


def _allocate(module: nn.Module, device: str | torch.device) -> None:
    if not isinstance(module, TiesWeights):
        raise TypeError(f"{type(module).__name__} has no tie_weights(); it is not a family's model or stage")
    module.to_empty(device=device)
    module.tie_weights()
    reset_buffers(module)


def _build(config: DecoderConfig, mesh: ParallelMesh, pieces: Callable[[DecoderForCausalLM], Iterator[nn.Module]],
           *, seed: int, device: str | torch.device, dtype: torch.dtype, sequence_parallel: bool, init: bool,
           rng_seed: int | None, hf_path: PathLike | None,
           deferred: bool = False) -> tuple[list[nn.Module], DeferredValues | None]:
    """The one build sequence: the full model on meta with its TP plan, the Hugging Face tensors
    checked against it, only this rank's experts kept; then each of ``pieces(full)`` (the model
    itself, or this rank's stages, taken one at a time) allocated on ``device`` and filled, or,
    ``deferred``, given placeholders whose values the returned :class:`DeferredValues` produces."""
    rng = TensorParallelRNG(seed if rng_seed is None else rng_seed, mesh.tp_rank)
    full = _meta_model(config, mesh, dtype, sequence_parallel, rng)
    tensors = check_hf_tensors(full, hf_path) if hf_path is not None else None
    apply_expert_parallel([full], mesh.info("ep"))  # only this rank's experts from here on
    values = DeferredValues(seed=seed, std=config.initializer_range, tensors=tensors,
                            device=torch.device(device)) if deferred else None
    built = []
    for module in pieces(full):
        if values is not None:  # placeholders: the optimizer fills them, range by range
            values.place(module)
            reset_buffers(module)
        else:
            _allocate(module, device)
        if sequence_parallel:  # MoE layers see sequence shards: their gradients are summed over TP
            sum_moe_gradients_over_tp([module], mesh.info("tp"))
        if values is None and tensors is not None:
            read_hf_tensors(module, tensors)
        elif values is None and init:
            init_parameters(module, seed, config.initializer_range)
        built.append(module)
    return built, values


def build_model(config: DecoderConfig, mesh: ParallelMesh, *, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, sequence_parallel: bool = False, init: bool = True,
                rng_seed: int | None = None, hf_path: PathLike | None = None) -> nn.Module:
    """This rank's shard of the full (unsplit) model of ``config``'s family on ``device``.

    Weights come from ``hf_path`` (a Hugging Face directory, checked against the model before
    anything is allocated) when given, else from ``seed`` unless ``init=False``.
    ``rng_seed`` seeds ``model.rng_tracker`` (default ``seed``). With ``mesh.ep > 1`` the model
    holds only this rank's experts and exchanges tokens over ``mesh.group("ep")``.
    """
    (model,), _ = _build(config, mesh, lambda full: iter([full]), seed=seed, device=device, dtype=dtype,
                         sequence_parallel=sequence_parallel, init=init, rng_seed=rng_seed, hf_path=hf_path)
    return model


def load_from_hf(path: PathLike, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """This rank's shard of the Hugging Face model at ``path`` on ``mesh``, of the family its
    ``config.json`` names (config, build, load)."""
    config = load_hf_config(path)
    return build_model(config, mesh, sequence_parallel=sequence_parallel, dtype=dtype, device=device, hf_path=path)


def build_stages(config: DecoderConfig, mesh: ParallelMesh, stage_layers: list[list[int]], *, seed: int = 0,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 sequence_parallel: bool = False, init: bool = True, rng_seed: int | None = None,
                 hf_path: PathLike | None = None) -> list[nn.Module]:
    """This rank's pipeline stages (its virtual chunks, in chunk order), each allocated alone.

    ``stage_layers[s]`` lists the decoder layers of global stage ``s`` (``len == pp * vpp``); rank
    ``r`` holds stages ``r, r + pp, ...`` (chunk ``c`` is stage ``c * pp + r``). The full model is
    only ever described on the meta device: nothing outside this rank's stages is allocated.
    With one stage holding every layer (pp=1) the stage has the full model's parameter names and
    computes exactly what the full model does.

    Weights come from ``hf_path`` when given: its names and shapes are checked once against the
    full model, then each stage reads only its own tensors (its TP slices of them, its experts).
    Otherwise they are the layout-invariant initial values of ``seed`` unless ``init=False``.

    The stages share one ``rng_tracker`` seeded from ``rng_seed`` (default ``seed``) and the TP
    rank; pass a ``rng_seed`` that depends on the pipeline rank for streams that also differ
    between pipeline ranks.
    """
    built, _ = _build(config, mesh, _stage_pieces(config, mesh, stage_layers), seed=seed, device=device, dtype=dtype,
                      sequence_parallel=sequence_parallel, init=init, rng_seed=rng_seed, hf_path=hf_path)
    return built


def build_stages_deferred(config: DecoderConfig, mesh: ParallelMesh, stage_layers: list[list[int]], *, seed: int = 0,
                          device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                          sequence_parallel: bool = False, rng_seed: int | None = None,
                          hf_path: PathLike | None = None) -> tuple[list[nn.Module], DeferredValues]:
    """:func:`build_stages` without allocating the trainable weights: every parameter is a
    placeholder (no memory) whose values, from ``seed`` or ``hf_path``, the returned
    :class:`~plait.deferred.DeferredValues` produces range by range. Pass it to the optimizer
    (:class:`~plait.data_parallel.optimizer.DistributedOptimizer`'s ``values``), which under
    ZeRO-3 computes or reads only the ranges this rank keeps: the build's peak memory is the
    rank's shard plus one row window, not its whole local model."""
    built, values = _build(config, mesh, _stage_pieces(config, mesh, stage_layers), seed=seed, device=device,
                           dtype=dtype, sequence_parallel=sequence_parallel, init=True, rng_seed=rng_seed,
                           hf_path=hf_path, deferred=True)
    assert values is not None
    return built, values


def _stage_pieces(config: DecoderConfig, mesh: ParallelMesh,
                  stage_layers: list[list[int]]) -> Callable[[DecoderForCausalLM], Iterator[nn.Module]]:
    """This rank's stages cut from the full model, each only once the one before it is allocated
    and filled (rank ``r`` holds stages ``r, r + pp, ...``)."""
    stage_cls = family_of(config).stage_cls
    num_stages = len(stage_layers)

    def stages(full: DecoderForCausalLM) -> Iterator[nn.Module]:
        for s in range(mesh.pp_rank, num_stages, mesh.pp):
            yield stage_cls(full, stage_layers[s], first=s == 0, last=s == num_stages - 1)

    return stages

