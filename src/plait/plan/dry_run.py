"""Dry run of one rank of a layout: the real mesh and model build, with no memory and no data.

:func:`dry_run` initialises the ``fake`` process-group backend for ``world`` ranks as ``rank``
(every collective is a no-op, so a 1024-rank world runs in one process), builds the real
:class:`~plait.mesh.ParallelMesh` with all its groups and this rank's model exactly as training
does, tensor-parallel plan and pipeline stages included, but on the ``meta`` device (shapes and
dtypes, no storage), then records every local parameter and compares their bytes with the
memory model's ``parameters`` for that rank. The process group is destroyed afterwards. With
expert parallelism (``layout.ep > 1``) the mesh has its expert groups and the builder keeps only
the rank's ``experts / ep`` of each MoE layer, so the check covers the memory model's expert
split too (``expert_bytes``: the built routed-expert parameters).

What it proves: the degrees build (head layout, KV replication, pipeline split, groups), and the
memory model's parameter count is the one the code allocates. Padding entries (vocabulary rows
padded to a multiple of ``tp``, padding attention heads) are real allocations; they are reported
apart, and a match "within padding accounting" means the estimate equals the bytes without them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
from plait.materialize import build_model, build_stages
from plait.mesh import ParallelMesh
from plait.moe.expert_parallel import expert_parameter_names
from plait.parallel_state import shard_specs
from plait.plan.degrees import ParallelDegrees
from plait.plan.memory import PRECISIONS, estimate_memory, precision_bytes
from plait.plan.pipeline_split import plan_partition
from plait.plan.search import PlanError
from plait.precision import policy_for

_DTYPE_BYTES_FALLBACK = 4


@dataclass(frozen=True)
class ParamRecord:
    """One local parameter of the dry-run rank."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    bytes: int
    padding_numel: int = 0   # entries that are padding (no counterpart in the full tensor)


@dataclass
class DryRunReport:
    """What :func:`dry_run` built for one rank and how it compares with the memory model."""

    layout: ParallelDegrees
    world: int
    rank: int
    coords: dict[str, int]
    group_sizes: dict[str, int]
    stages: list[tuple[int, list[int], bool, bool]]   # (global stage, decoder layers, first, last)
    parameters: list[ParamRecord] = field(default_factory=list)
    estimated_param_bytes: int = 0
    seconds: float = 0.0
    estimated_expert_param_count: int = 0   # MoE: the memory model's routed-expert parameters
    #: ZeRO (``layout.zero >= 1`` and more than one data-parallel rank): the built optimizer's
    #: persistent bytes per rank (``DistributedOptimizer.memory_report``) and the estimate's
    zero_built: dict[str, int] = field(default_factory=dict)
    zero_estimated: dict[str, int] = field(default_factory=dict)

    @property
    def expert_param_count(self) -> int:
        """Built routed-expert parameters (an ``experts.<index>.`` in the name)."""
        return sum(p.numel for p in self.parameters if ".experts." in p.name)

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.parameters)

    @property
    def param_bytes(self) -> int:
        return sum(p.bytes for p in self.parameters)

    @property
    def padding_bytes(self) -> int:
        return sum(p.padding_numel * p.bytes // max(p.numel, 1) for p in self.parameters)

    @property
    def difference(self) -> int:
        """Built minus estimated parameter bytes."""
        return self.param_bytes - self.estimated_param_bytes

    @property
    def matches_exactly(self) -> bool:
        return self.difference == 0 and self.expert_param_count == self.estimated_expert_param_count

    @property
    def matches(self) -> bool:
        """Equal, or equal once the padding entries are left out of the built bytes."""
        same = self.difference == 0 or self.param_bytes - self.padding_bytes == self.estimated_param_bytes
        return same and self.expert_param_count == self.estimated_expert_param_count

    @property
    def zero_matches(self) -> bool:
        """Every sharded state the estimate prices equals the built one within bucket padding (each
        bucket is padded to a multiple of the data-parallel degree)."""
        slack = self.zero_built.get("padding_bytes", 0)
        return all(abs(self.zero_built[k] - v) <= slack for k, v in self.zero_estimated.items())

    def zero_line(self) -> str:
        """The sharded states of a ZeRO layout, built vs estimated (empty without ZeRO)."""
        if not self.zero_built:
            return ""
        gib = 1024**3
        parts = [f"{k.replace('_bytes', '').replace('_', ' ')} {self.zero_built[k] / gib:.3f} GiB "
                 f"(estimated {v / gib:.3f})" for k, v in self.zero_estimated.items()]
        verdict = "match within bucket padding" if self.zero_matches else "MISMATCH"
        return f"  ZeRO-{self.layout.zero} per rank: " + ", ".join(parts) + f": {verdict}"

    def stage_text(self) -> str:
        if not self.stages:
            return "whole model"
        parts = []
        for s, layers, first, last in self.stages:
            span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
            extra = (" +embedding" if first else "") + (" +head" if last else "")
            parts.append(f"stage {s}: {span}{extra}")
        return "; ".join(parts)

    def check_line(self) -> str:
        gib = 1024**3
        c = self.coords
        verdict = ("match" if self.matches_exactly else
                   f"match without {self.padding_bytes} padding bytes" if self.matches else
                   f"MISMATCH by {self.difference:+d} bytes" if self.difference else "MISMATCH in the experts")
        experts = (f", {self.expert_param_count:,} of them in experts (estimated "
                   f"{self.estimated_expert_param_count:,})" if self.estimated_expert_param_count else "")
        return (f"rank {self.rank} (pp {c['pp']}, dp {c['dp']}, tp {c['tp']}; {self.stage_text()}): "
                f"{len(self.parameters)} tensors, {self.param_count:,} parameters{experts}, built "
                f"{self.param_bytes / gib:.3f} GiB vs estimated {self.estimated_param_bytes / gib:.3f} GiB: "
                f"{verdict} [{self.seconds:.1f} s]")

    def as_dict(self) -> dict:
        return {
            "layout": self.layout.as_dict(), "world": self.world, "rank": self.rank, "coords": self.coords,
            "group_sizes": self.group_sizes,
            "stages": [{"stage": s, "layers": layers, "first": first, "last": last}
                       for s, layers, first, last in self.stages],
            "param_count": self.param_count, "param_bytes": self.param_bytes,
            "padding_bytes": self.padding_bytes, "estimated_param_bytes": self.estimated_param_bytes,
            "matches": self.matches, "matches_exactly": self.matches_exactly, "seconds": self.seconds,
            "expert_param_count": self.expert_param_count,
            "estimated_expert_param_count": self.estimated_expert_param_count,
        }


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the parameters live in under a precision preset (the trainer's fp32 model for
    ``fp32`` and ``autocast``; bf16 weights for the bf16 presets)."""
    p = str(precision).lower()
    if p in ("bf16-pure", "bf16-mixed", "bf16", "bfloat16"):
        return torch.bfloat16
    if p in ("fp16", "float16", "fp16-mixed"):
        return torch.float16
    return torch.float32


def _padding(param: torch.Tensor, spec) -> int:
    if spec is None:
        return 0
    pad_rows = sum(1 for i in spec.index if i < 0)
    if not pad_rows:
        return 0
    return pad_rows * param.numel() // max(param.shape[spec.dim], 1)


def _records(modules: list[torch.nn.Module]) -> list[ParamRecord]:
    seen: set[int] = set()
    out = []
    for module in modules:
        specs = shard_specs(module)
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            size = p.element_size() if p.dtype.is_floating_point or p.dtype.is_complex else _DTYPE_BYTES_FALLBACK
            out.append(ParamRecord(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.numel(),
                                   p.numel() * size, _padding(p, specs.get(name))))
    return out


def dry_run(config, layout: ParallelDegrees, world: int, rank: int, *, precision: str = "autocast",
            micro_batch_size: int = 1, seq_len: int, microbatches: int = 1, partition: str = "balanced",
            partition_cost: str = "flops", pipeline_cuts: list[str] | None = None,
            kv_placement: str = "interleaved", stage_layers: list[list[int]] | None = None) -> DryRunReport:
    """Build ``rank``'s share of ``config`` under ``layout`` on ``world`` fake ranks (module docstring).

    The pipeline split is :func:`~plait.plan.pipeline_split.plan_partition` with ``partition`` /
    ``partition_cost`` / ``pipeline_cuts``, as the trainer uses, unless ``stage_layers`` (the decoder
    layers of each of the ``pp * vpp`` global stages) is given, e.g. computed once for several
    ranks. Raises :class:`PlanError` when the
    layout does not fit the world, the rank is out of range, or a process group already exists.
    """
    if layout.world != world:
        raise PlanError(f"layout {layout.short()} has tp*pp*dp*cp = {layout.world} ranks, not the world {world}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise PlanError(f"rank={rank!r} is outside the world: valid 0..{world - 1}")
    if dist.is_available() and dist.is_initialized():
        raise PlanError("a torch.distributed process group is already initialised in this process; "
                        "the dry run needs its own fake one (run it outside training)")
    start = time.perf_counter()
    dtype = param_dtype(precision)
    if layout.pp == 1:
        stage_layers = None
    elif stage_layers is not None:
        if len(stage_layers) != layout.pp * layout.vpp:
            raise PlanError(f"stage_layers has {len(stage_layers)} stages, the layout {layout.pp * layout.vpp}")
    else:
        part = plan_partition(config, layout.pp * layout.vpp, seq_len, method=partition, cost=partition_cost,
                              cuts=pipeline_cuts)
        stage_layers = part.stage_layers()
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        mesh = ParallelMesh(world, rank, tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, ep=layout.ep,
                            kv_replication=layout.kv_replication, kv_placement=kv_placement)
        axes = ("tp", "pp", "dp", "kv") + (("ep", "dp_expert") if layout.ep > 1 else ())
        group_sizes = {axis: len(mesh.my_group_ranks(axis)) for axis in axes}
        sp = layout.sequence_parallel and layout.tp > 1
        if stage_layers is None:
            modules = [build_model(config, mesh, device="meta", dtype=dtype, sequence_parallel=sp, init=False)]
            stages: list[tuple[int, list[int], bool, bool]] = []
        else:
            modules = build_stages(config, mesh, stage_layers, device="meta", dtype=dtype,
                                   sequence_parallel=sp, init=False)
            n = len(stage_layers)
            stages = [(s, list(stage_layers[s]), s == 0, s == n - 1) for s in range(mesh.pp_rank, n, mesh.pp)]
        coords = {k: v for k, v in mesh.coords().items() if k != "cp"}
        records = _records(modules)
        built = _zero_states(modules, mesh, layout, precision)
        del modules
    finally:
        dist.destroy_process_group()
    estimate = estimate_memory(config, layout, precision=precision, micro_batch_size=micro_batch_size,
                               seq_len=seq_len, microbatches=microbatches, stage=coords["pp"],
                               stage_layers=stage_layers)
    pb = precision_bytes(precision)
    expected = {}
    if built:
        expected = {"optimizer_state_bytes": estimate.optimizer, "grad_bytes": estimate.gradient_shard}
        owned = (estimate.host_bytes // 16 if layout.offload else estimate.optimizer // 2 // pb.optimizer_state)
        if layout.zero == 3:
            expected["weight_bytes"] = owned * pb.param
        if layout.offload:
            expected["host_bytes"] = estimate.host_bytes
        if layout.zero == 1:
            del expected["grad_bytes"]  # ZeRO-1 keeps the whole gradient buffer (gloo: no shard buffer)
    return DryRunReport(layout=layout, world=world, rank=rank, coords=coords, group_sizes=group_sizes,
                        stages=stages, parameters=records,
                        estimated_param_bytes=estimate.parameter_count * pb.param,
                        estimated_expert_param_count=estimate.expert_parameter_count,
                        seconds=time.perf_counter() - start, zero_built=built, zero_estimated=expected)


def _zero_states(modules: list[torch.nn.Module], mesh: ParallelMesh, layout: ParallelDegrees,
                 precision: str) -> dict[str, int]:
    """The persistent per-rank bytes of the optimizer the trainer would build for a ZeRO layout
    (on ``meta``: buckets, owned ranges and ZeRO-3 chunks are laid out, nothing is allocated);
    empty without ZeRO or data parallelism. The model's parameters are left freed (ZeRO-3)."""
    dp = mesh.info("dp_cp")
    if layout.zero < 1 or dp.size == 1:
        return {}
    for module in modules:
        for p in module.parameters():
            p.requires_grad_(True)
    policy = policy_for(precision if precision in PRECISIONS else "bf16-pure")
    opt = DistributedOptimizer(modules, policy, OptimizerHyper(lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8),
                               dp=dp, tp=mesh.info("tp"), pp=mesh.info("pp"),
                               tied=mesh.info("tied") if mesh.pp > 1 else None, zero=layout.zero,
                               offload=layout.offload,
                               ep=mesh.info("ep"), expert_dp=mesh.info("dp_expert"),
                               expert_names=expert_parameter_names(modules))
    report = opt.memory_report()
    item = torch.empty((), dtype=policy.grad_dtype).element_size()
    return {"optimizer_state_bytes": 0 if layout.offload else report["expected_state_bytes"],
            "grad_bytes": report["grad_bytes"], "weight_bytes": report["weight_bytes"],
            "host_bytes": report["host_bytes"],
            "padding_bytes": report["padding_elements"] * max(item, 4) * 2}


__all__ = ["DryRunReport", "ParamRecord", "dry_run", "param_dtype"]
