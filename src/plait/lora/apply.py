"""Put LoRA adapters on a model's decoder blocks, initialise them, fold them into the base weights.

Works on whatever a rank holds: the unsharded model (plain ``nn.Linear`` projections), its
tensor-parallel twin (after ``parallelize``), or its pipeline stages (each holding some of the
blocks under the full model's names). Adapters are found again by walking the same blocks, so
nothing else needs to remember them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from plait.activation_checkpointing import decoder_blocks
from plait.comm.primitives import GroupInfo
from plait.init import name_seed
from plait.lora.layers import BASE_CLASS, LORA_CLASS, AdapterKind, LoraAdapter, adapter_of
from plait.lora.settings import CONTAINER_OF, TARGETS, LoraSettings
from plait.tensor_parallel.attention import ParallelSelfAttention
from plait.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from plait.tensor_parallel.random import TensorParallelRNG
from plait.tensor_parallel.sharding import ShardSpec


class LoraApplyError(ValueError):
    """A model LoRA cannot be applied to as asked (the message names the module and the fix)."""


@dataclass(frozen=True)
class Projection:
    """One target projection of one decoder block: ``name`` is its qualified name in the model
    (``model.layers.3.self_attn.q_proj``), ``target`` the projection's own name (``q_proj``)."""

    name: str
    target: str
    container: nn.Module
    module: nn.Module


def projections(modules: list[nn.Module]) -> Iterator[Projection]:
    """Every projection of every decoder block of ``modules`` (models or pipeline stages), in order."""
    for root in modules:
        for block_name, block in decoder_blocks(root):
            for target in TARGETS:
                container = getattr(block, CONTAINER_OF[target], None)
                module = getattr(container, target, None)
                if container is not None and isinstance(module, nn.Module):
                    yield Projection(f"{block_name}.{CONTAINER_OF[target]}.{target}", target, container, module)


def adapted(modules: list[nn.Module]) -> Iterator[tuple[Projection, LoraAdapter]]:
    """Every projection that carries an adapter, with the adapter."""
    for proj in projections(modules):
        adapter = adapter_of(proj.module)
        if adapter is not None:
            yield proj, adapter


@contextlib.contextmanager
def adapters_disabled(modules: list[nn.Module]) -> Iterator[None]:
    """Inside, every adapter of ``modules`` is skipped: the model computes its base weights alone
    (the reference model of DPO/IPO with LoRA: no second copy of the base). Nothing is drawn
    from any generator for the skipped adapters; they are enabled again on exit, even on error."""
    found = [adapter for _, adapter in adapted(modules)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


def apply_lora(modules: list[nn.Module], settings: LoraSettings, *, seed: int,
               dtype: torch.dtype = torch.float32) -> int:
    """Add an adapter to each ``settings.target_modules`` projection of every decoder block, in place.

    Afterwards only adapter parameters require gradients (every base parameter of ``modules`` is
    frozen). ``A`` starts from ``(seed, its full parameter name)`` over the full shape, so every
    layout starts from the same adapter; ``B`` starts at zero. On the meta device nothing is
    drawn: call :func:`init_lora_` after allocating. ``dtype`` is the adapters' own dtype
    (fp32 by default, whatever the base weights' dtype). Returns the number of adapted projections.
    """
    if not isinstance(settings, LoraSettings):
        raise TypeError(f"apply_lora needs a LoraSettings, got {type(settings).__name__}")
    chosen = [(root, p) for root in modules for p in projections([root]) if p.target in settings.target_modules]
    for _, proj in chosen:
        _check_adaptable(proj)
    for root in modules:
        for p in root.parameters():
            p.requires_grad_(False)
    for root, proj in chosen:
        rng = getattr(root, "rng_tracker", None)
        adapter = _new_adapter(proj, settings, rng if isinstance(rng, TensorParallelRNG) else None, dtype)
        adapter.settings = settings
        _swap_class(proj.module, LORA_CLASS)
        proj.module.lora = adapter  # registered as a submodule: its parameters require grad
        _swap_class(proj.container, LORA_CLASS)  # the fused parallel projections (no-op for the plain model)
    init_lora_(modules, seed=seed)
    return len(chosen)


@torch.no_grad()
def init_lora_(modules: list[nn.Module], *, seed: int) -> None:
    """(Re)initialise every adapter of ``modules`` (see :meth:`LoraAdapter.reset_parameters`);
    adapters on the meta device are skipped."""
    for proj, adapter in adapted(modules):
        if adapter.A.device.type != "meta":
            adapter.reset_parameters(name_seed(seed, f"{proj.name}.lora.A"))


def lora_parameters(modules: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """``(qualified name, parameter)`` of every adapter parameter, ``A`` before ``B``, block order."""
    return [(f"{proj.name}.lora.{k}", p) for proj, adapter in adapted(modules)
            for k, p in (("A", adapter.A), ("B", adapter.B))]


@torch.no_grad()
def merge_lora_(modules: list[nn.Module]) -> int:
    """Fold every adapter into its base weight (``W += scale * B A``) and remove it, in place.

    Each rank merges its own slices (the local ``B A`` is exactly this rank's slice of the full
    product, padding included), so no communication is needed. The model is then the base
    architecture again (the classes are restored); ``requires_grad`` flags are left as they are.
    Returns the number of merged projections.
    """
    merged = list(adapted(modules))
    stored = [proj.name for proj, _ in merged if not isinstance(proj.module.weight, nn.Parameter)]
    if stored:  # a quantized base (plait.quantize) holds codes: adding to its dense view would be lost
        raise LoraApplyError(f"{stored[0]} is stored quantized (a frozen buffer, not a parameter); merging "
                             f"into it would change nothing: dequantize the base first "
                             f"(plait.quantize.dequantize_base_) to merge into the base as trained")
    for proj, adapter in merged:
        weight = proj.module.weight
        assert isinstance(weight, torch.Tensor), f"{proj.name} has no weight"
        delta = adapter.scale * (adapter.B.float() @ adapter.A.float())
        weight.add_(delta.to(weight.dtype))
        del proj.module.lora
        _swap_class(proj.module, BASE_CLASS)
    for proj in projections(modules):
        if type(proj.container) in BASE_CLASS:
            _swap_class(proj.container, BASE_CLASS)
    return len(merged)


# ------------------------------------------------------------------------------ building one adapter
def _check_adaptable(proj: Projection) -> None:
    if adapter_of(proj.module) is not None or type(proj.module) in BASE_CLASS:
        raise LoraApplyError(f"{proj.name} already has a LoRA adapter; apply_lora was called twice on this "
                             f"model (merge_lora_ first to start a new adapter)")
    if type(proj.module) not in LORA_CLASS:
        raise LoraApplyError(f"{proj.name} is a {type(proj.module).__name__}; LoRA adapts nn.Linear, "
                             f"ColumnParallelLinear and RowParallelLinear projections only")
    if isinstance(proj.module, ColumnParallelLinear):
        if proj.module.gather_output:
            raise LoraApplyError(f"{proj.name} gathers its output (gather_output=True); LoRA supports the "
                                 f"sharded-output layers of attention and the MLP only")
        # a container that calls the projection as a module lets its LoRA class add the adapter; one
        # that reads the weight into a fused matmul must be one whose LoRA twin adds it (LORA_CLASS)
        calls_module = getattr(type(proj.container), "calls_its_projections", False)
        if not calls_module and type(proj.container) not in LORA_CLASS and type(proj.container) not in BASE_CLASS:
            raise LoraApplyError(f"{proj.name} sits in a {type(proj.container).__name__}, whose fused projection "
                                 f"LoRA does not know; supported: ParallelSelfAttention, ParallelGatedMLP, "
                                 f"ParallelFusedSelfAttention, ParallelDenseMLP")


def _swap_class(module: nn.Module, mapping: dict[type[nn.Module], type[nn.Module]]) -> None:
    """Give ``module`` the class ``mapping`` pairs with its exact class (same state, other forward)."""
    new = mapping.get(type(module))
    if new is not None:
        module.__class__ = new


def _new_adapter(proj: Projection, settings: LoraSettings, rng: TensorParallelRNG | None,
                 dtype: torch.dtype) -> LoraAdapter:
    """An adapter laid out like ``proj``'s base weight (see :mod:`plait.lora.layers`)."""
    module, r = proj.module, settings.rank
    weight = module.weight
    assert isinstance(weight, torch.Tensor), f"{proj.name} has no weight"
    in_features, out_features = int(weight.shape[1]), int(weight.shape[0])
    kind: AdapterKind = "plain"
    a_spec: ShardSpec | None = None
    b_spec: ShardSpec | None = None
    tp, sp, seq_dim, kv, m = GroupInfo.single(), False, 1, None, 1
    if isinstance(module, ColumnParallelLinear | RowParallelLinear):
        if settings.dropout > 0 and rng is None:
            raise LoraApplyError(
                f"lora.dropout={settings.dropout} on the tensor-parallel {proj.name} needs the model's per-rank "
                f"random stream (`rng_tracker`, set by plait.materialize); build the model with plait.materialize "
                f"or set dropout=0")
        tp, spec = module.tp, module.weight_spec
        in_features, out_features = module.in_features, module.out_features
    if isinstance(module, ColumnParallelLinear):
        kind, b_spec = "column", ShardSpec(0, spec.index, (out_features, r), spec.replicas)
        # the fused projection gathers the sequence, so the container knows whether SP is on
        sp = bool(getattr(proj.container, "sequence_parallel", False))
        if proj.target in ("k_proj", "v_proj") and isinstance(proj.container, ParallelSelfAttention):
            kv, m = proj.container.kv, proj.container.layout.kv_replication
    elif isinstance(module, RowParallelLinear):
        kind, a_spec = "row", ShardSpec(1, spec.index, (r, in_features))
        sp, seq_dim = module.sequence_parallel, module.seq_dim
    return LoraAdapter(kind, a_spec, b_spec, (r, in_features), (out_features, r), scale=settings.scale,
                       dropout=settings.dropout, tp=tp, sequence_parallel=sp, seq_dim=seq_dim, kv=kv,
                       kv_replication=m, rng=rng, device=weight.device, dtype=dtype)
