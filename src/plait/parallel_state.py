"""Model-wide views of sharding: which parameters are sharded how, and the full state dict.

These functions work on any model built from plait's parallel layers: every module that shards
a parameter exposes ``shard_specs() -> {param_name: ShardSpec}``; parameters without a spec are
replicated over the TP group.
"""

from __future__ import annotations

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
            specs[owners[id(param)]] = spec
    return specs


def named_parameters_with_specs(modules: list[nn.Module]) -> list[tuple[nn.Module, str, nn.Parameter, ShardSpec | None]]:
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


@torch.no_grad()
def full_state_dict(model: nn.Module, tp: GroupInfo) -> dict[str, torch.Tensor]:
    """Every parameter as its full, unpadded tensor (on every rank), gathered over the TP group."""
    specs = shard_specs(model)
    every_rank_specs = [specs]
    if tp.size > 1:  # one object exchange for all parameters; specs are small index tuples
        every_rank_specs = [None] * tp.size
        dist.all_gather_object(every_rank_specs, specs, group=tp.group)
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
