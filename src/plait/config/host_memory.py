"""The model state of a recipe against this host's physical memory: refuse what cannot be allocated.

A model too large for the machine otherwise fails after launch, each rank dying while it
materializes its shard, with a launcher traceback per rank. The check is deliberately a lower
bound on the need, so it refuses only what certainly cannot run here:

* on a CPU host the planner's peak of a step counts (model state, activations, logits and
  communication buffers: :attr:`plait.plan.memory.MemoryBreakdown.total`, measured within a few
  percent of the real peak, see docs/plan_memory.md); allocator caches and the framework itself
  come on top; on an accelerator host only the model state counts;
* on a CPU host every process on it keeps its state in host memory, so the state of all the
  processes this host runs is compared with its physical memory. ``plait train`` runs the whole
  world here; under torchrun/SLURM ``LOCAL_WORLD_SIZE`` says how many processes this host runs;
* with CUDA a process keeps its state on its device, which the parent process cannot price
  without creating a CUDA context on the first device; the state of one process is then compared
  with the host's memory (no device holds more than its host, and checkpoints stage each rank's
  state in host memory).
"""

from __future__ import annotations

import os

import torch

from plait.config.problems import Problem, Verbatim
from plait.config.resolve import ResolvedRecipe
from plait.config.schema import Recipe
from plait.plan.adapters import AdapterPlan
from plait.plan.degrees import ParallelDegrees
from plait.plan.memory import PRECISIONS, estimate_memory
from plait.plan.pipeline_split import plan_partition

GiB = 1024**3


def host_memory_bytes() -> int | None:
    """Physical memory of this host, ``None`` where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def processes_on_this_host(world_size: int) -> int:
    """``LOCAL_WORLD_SIZE`` inside a launched world (torchrun, SLURM), else the whole world
    (``plait train`` starts every process here)."""
    if "WORLD_SIZE" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        try:
            return max(1, min(world_size, int(os.environ["LOCAL_WORLD_SIZE"])))
        except ValueError:
            pass
    return world_size


def _accelerated() -> bool:
    """True when training would run on CUDA devices (the trainer's rule); creates no context."""
    return torch.cuda.is_available()


def recipe_layout(resolved: ResolvedRecipe) -> ParallelDegrees:
    """The recipe's own layout as the planner describes layouts."""
    r, p = resolved.recipe, resolved.recipe.parallel
    checkpointing = r.train.activation_checkpointing
    return ParallelDegrees(tp=p.tp, pp=p.pp, dp=resolved.dp, vpp=p.vpp, kv_replication=resolved.kv_replication,
                           sequence_parallel=p.sequence_parallel, zero=p.zero_level(),
                           activation_checkpointing="none" if checkpointing == "off" else checkpointing,
                           schedule=p.schedule, cp=p.cp, ep=p.ep, offload=p.offload_optimizer)


def adapter_plan(recipe: Recipe) -> AdapterPlan | None:
    """The recipe's LoRA section as the planner prices it (``None``: every weight trains)."""
    lo = recipe.lora
    if lo.rank is None:
        return None
    return AdapterPlan(lo.rank, tuple(lo.target_modules), lo.quantize_base, lo.quantize_block_size)


def state_bytes_per_stage(resolved: ResolvedRecipe, *, with_activations: bool = False) -> tuple[list[int], str]:
    """``(model-state bytes of one process of each pipeline rank, precision priced)``; with
    ``with_activations``, the planner's peak of the step instead (activations, logits and
    communication buffers included).

    A ``manual`` precision is priced as ``bf16-pure``, the preset with the fewest bytes per
    parameter, so the estimate stays a lower bound.
    """
    r, p = resolved.recipe, resolved.recipe.parallel
    precision = r.precision.preset if r.precision.preset in PRECISIONS else "bf16-pure"
    layout = recipe_layout(resolved)
    config = resolved.model_config()
    seq = r.data.seq_len
    split = None
    if p.pp * p.vpp > 1:
        split = plan_partition(config, p.pp * p.vpp, seq, method=p.partition, cost=p.partition_cost,
                               cuts=p.pipeline_cuts).stage_layers()
    adapters = adapter_plan(r)
    estimates = [estimate_memory(config, layout, precision=precision, micro_batch_size=r.data.micro_batch_size,
                                 seq_len=seq, microbatches=p.microbatches, stage=s, stage_layers=split,
                                 adapters=adapters)
                 for s in range(p.pp)]
    peaks = [e.total for e in estimates] if with_activations else [e.model_states for e in estimates]
    return peaks, precision


def local_state_bytes(states: list[int], world_size: int, local: int) -> int:
    """Model-state bytes of the ``local`` processes on this host, from each pipeline rank's
    per-process ``states``: exact when they are the whole world (each pipeline rank has
    ``world / pp`` processes), else ``local`` times the largest."""
    if local == world_size:
        return sum(states) * (world_size // len(states))
    return max(states) * local


def _size(n: int) -> str:
    if n < 1024 * GiB:
        return f"{n / GiB:,.1f} GiB"
    if n < 10**9 * 1024**4:
        return f"{n / 1024**4:,.1f} TiB"
    return f"~10^{len(str(n)) - 1} bytes"  # beyond what a float division can print


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n < 10**15 else f"~10^{len(str(n)) - 1}"


def model_state_problem(resolved: ResolvedRecipe, *, memory: int | None = None,
                        local: int | None = None, accelerated: bool | None = None) -> Problem | None:
    """A :class:`Problem` when the model state cannot fit this host (see the module doc), else
    ``None``. ``memory``, ``local`` and ``accelerated`` default to this machine's."""
    memory = host_memory_bytes() if memory is None else memory
    if not memory:
        return None
    accelerated = _accelerated() if accelerated is None else accelerated
    local = processes_on_this_host(resolved.world_size) if local is None else local
    # on a CPU host the activations live in host memory too (a micro-batch of thousands of sequences
    # would meet the kernel's out-of-memory killer); a device holds its own
    states, precision = state_bytes_per_stage(resolved, with_activations=not accelerated)
    need = max(states) if accelerated else local_state_bytes(states, resolved.world_size, local)
    if need <= memory:
        return None
    params = resolved.num_parameters()
    who = "one process" if accelerated or local == 1 else f"{local} processes on this host"
    p = resolved.recipe.parallel
    return Problem(
        "model", Verbatim(f"{_count(params)} parameters"),
        f"the {'model state' if accelerated else 'step peak'} of {who} ({_size(need)}: parameters, gradients and "
        f"optimizer state in {precision}{'' if accelerated else ', activations of data.micro_batch_size='}"
        f"{'' if accelerated else resolved.recipe.data.micro_batch_size}, tp={p.tp} pp={p.pp} dp={resolved.dp}"
        f"{f' zero{p.zero_level()}' if p.zero_level() else ''}) exceeds this host's {_size(memory)} of "
        f"physical memory; use a smaller "
        f"model or micro-batch, activation checkpointing, or shard it over more processes (parallel.tp, "
        f"parallel.pp, parallel.zero) on more hosts")
