"""Model-wide views of sharding: which parameters are sharded how, which copy of a replicated
parameter counts, and the full state dict.

These functions work on any model built from plait's parallel layers: every module that shards
a parameter exposes ``shard_specs() -> {param_name: ShardSpec}``; parameters without a spec are
replicated over the TP group. A pipeline stage that holds a copy of another stage's parameter
(the tied embedding) says so through ``secondary_copies()`` and ``shared_across_stages()``, so no
parameter name is hard-coded outside the model family.

Canonical ownership, decided here once and used by the gradient norm (the optimizer) and the
checkpoint writer: a parameter replicated over TP counts on TP rank 0; a TP shard held by
``replicas`` KV-replica ranks counts ``1 / replicas`` on each of them in the norm and is written by
the first replica (KV rank 0); a secondary copy on another pipeline stage never counts. DP replicas
are handled by their callers (the norm is reduced over TP, PP and DP after the weights; the
writer splits the parameters over DP ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.tensor_parallel.sharding import ShardSpec, assemble_from_shards


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """``{fully qualified parameter name: ShardSpec}`` for every sharded parameter.

    Tied parameters are reported under the name ``named_parameters`` uses (the first owner).
    """
    specs: dict[str, ShardSpec] = {}
    owners = {id(p): name for name, p in model.named_parameters()}
    for module in model.modules():
        get = getattr(module, "shard_specs", None)
        if get is None:
            continue
        for pname, spec in get().items():
            param = getattr(module, pname)
            if id(param) in owners:  # not a parameter: a frozen weight stored quantized (a buffer)
                specs[owners[id(param)]] = spec
    return specs


def secondary_copies(module: nn.Module) -> frozenset[str]:
    """Names of parameters ``module`` holds as a copy another pipeline stage owns (family-defined)."""
    get = getattr(module, "secondary_copies", None)
    return frozenset(get()) if get is not None else frozenset()


def shared_across_stages(module: nn.Module) -> frozenset[str]:
    """Names of parameters ``module`` shares with another pipeline stage (family-defined)."""
    get = getattr(module, "shared_across_stages", None)
    return frozenset(get()) if get is not None else frozenset()


def norm_share(module: nn.Module, name: str, spec: ShardSpec | None, tp_rank: int) -> float:
    """How much this rank's copy of ``name`` counts in the global gradient norm (see the module doc)."""
    if name in secondary_copies(module):
        return 0.0
    if spec is None:
        return 1.0 if tp_rank == 0 else 0.0
    return 1.0 / spec.replicas


def writes_copy(module: nn.Module, name: str, spec: ShardSpec | None, tp_rank: int, kv_rank: int) -> bool:
    """Whether this rank's copy of ``name`` is the one a checkpoint stores (see the module doc)."""
    if name in secondary_copies(module):
        return False
    if spec is None:
        return tp_rank == 0
    if spec.replicas > 1:
        return kv_rank == 0
    return True


def named_parameters_with_specs(
        modules: list[nn.Module]) -> list[tuple[nn.Module, str, nn.Parameter, ShardSpec | None]]:
    """``(owning module, name, parameter, spec or None)`` of every distinct parameter of ``modules``
    (a model, or a rank's pipeline stages), first owner first."""
    out, seen = [], set()
    for module in modules:
        specs = shard_specs(module)
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((module, name, p, specs.get(name)))
    return out


def _specs_of_every_rank(specs: dict[str, ShardSpec], tp: GroupInfo) -> list[dict[str, ShardSpec]]:
    """Each TP rank's ``specs``, in TP rank order: one object exchange for all parameters (specs are
    small index tuples)."""
    if tp.size == 1:
        return [specs]
    every_rank: list[Any] = [None] * tp.size
    dist.all_gather_object(every_rank, specs, group=tp.group)
    return every_rank


@torch.no_grad()
def full_state_dict(model: nn.Module, tp: GroupInfo) -> dict[str, torch.Tensor]:
    """Every parameter as its full, unpadded tensor (on every rank), gathered over the TP group."""
    specs = shard_specs(model)
    every_rank_specs = _specs_of_every_rank(specs, tp)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name not in specs:
            out[name] = p.detach().clone()
            continue
        if tp.size == 1:
            all_locals = [p.detach()]
        else:
            all_locals = [torch.empty_like(p) for _ in range(tp.size)]
            dist.all_gather(all_locals, p.detach().contiguous(), group=tp.group)
        out[name] = assemble_from_shards([s[name] for s in every_rank_specs], all_locals)
    return out
