"""``plait plan RECIPE --world N``: rank every parallel layout of a recipe's model on N devices.

Prints a table (layout, parameter / gradient / optimizer / activation / total GiB per rank, the
estimated step time and MFU, whether it fits) sorted by step time, then the recommended layout:
the fastest that fits in device memory less a 10% headroom. ``--dry-run`` then builds the
recommended layout's model for some ranks on a fake process group (nothing allocated, no data)
and checks the parameter bytes against the memory model. Only the recipe's model, data shape
and precision are used; its parallel section is what this command chooses. Errors are one line
on stderr and exit with status 2; a dry-run mismatch exits with 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

GiB = 1024**3
#: the largest --world and --nodes-of planned for (the search walks the divisors of both, so the
#: work stays bounded; the largest clusters are far smaller)
MAX_DEVICES = 1 << 20


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="rank the parallel layouts of a recipe's model on N devices (memory, step time, fit)",
        description="Enumerate every valid (tp, pp, vpp, dp, kv_replication, sequence parallel, ZeRO level 0-3, "
                    "activation checkpointing; ep for MoE models) layout of the recipe's model on --world devices, "
                    "estimate memory per rank and step time for each, and recommend the fastest that fits. TP stays "
                    "inside a node. The global batch is fixed in sequences (--global-batch, else the recipe's "
                    "data.global_batch_size, else 4Mi tokens, at most 1024 sequences), unless --microbatches "
                    "fixes the micro-batches per DP rank instead. Overrides (section.field=value) may follow "
                    "the recipe.")
    p.add_argument("recipe", metavar="RECIPE", help="recipe file whose model, data.seq_len, data.micro_batch_size "
                                                    "and precision are planned for")
    p.add_argument("items", nargs="*", metavar="section.field=value", help="recipe overrides")
    p.add_argument("--world", type=int, required=True, metavar="N", help="number of devices (ranks)")
    p.add_argument("--device", default="h100", metavar="NAME",
                   help="device from plait's table (h100, h200, a100, trn1, trn2, cpu); default h100. A cpu "
                        "device is one rank process: the ranks of a node share its host's RAM and cores and talk "
                        "through gloo (docs/plan.md)")
    p.add_argument("--memory", type=float, default=None, metavar="GB",
                   help="memory per device in GB (1e9 bytes); default: the device's (cpu: host RAM / ranks per "
                        "node)")
    p.add_argument("--headroom", type=float, default=0.10, metavar="FRACTION",
                   help="share of the memory kept free (allocator, context, NCCL); default 0.10")
    p.add_argument("--nodes-of", type=int, default=None, metavar="N", dest="nodes_of",
                   help="devices per node; TP degrees divide it (default 8; 16 for trn1/trn2; for cpu the world: "
                        "every rank on this host, as plait train runs them)")
    p.add_argument("--global-batch", type=int, default=None, metavar="SEQUENCES", dest="global_batch",
                   help="sequences per optimizer step, the same for every layout")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="micro-batches per step per DP rank instead of a fixed global batch")
    p.add_argument("--precision", default=None, metavar="PRESET",
                   help="precision preset to plan for (fp32, autocast, bf16-mixed, bf16-pure); default: the "
                        "recipe's precision.preset")
    p.add_argument("--top", type=int, default=10, metavar="K",
                   help="rows of layouts that fit in the table (default 10)")
    p.add_argument("--unfit", type=int, default=3, metavar="K",
                   help="also show up to K layouts faster than the recommendation that do not fit (default 3)")
    p.add_argument("--no-zero1", action="store_true", dest="no_zero1",
                   help="leave ZeRO (parallel.zero) out of the search: replicated weights, gradients and "
                        "optimizer states only")
    p.add_argument("--offload", action="store_true",
                   help="also try optimizer offload (parallel.offload_optimizer: the fp32 master and moments in "
                        "host memory, priced over the device's host link)")
    p.add_argument("--no-checkpointing", action="store_true", dest="no_checkpointing",
                   help="leave activation checkpointing (train.activation_checkpointing) out of the search")
    p.add_argument("--all", action="store_true", dest="every",
                   help="list every layout, also those a faster layout beats on memory")
    p.add_argument("--dry-run", action="store_true", dest="dry_run",
                   help="build the recommended layout on a fake process group and check parameter bytes")
    p.add_argument("--recipe-layout", action="store_true", dest="recipe_layout",
                   help="with --dry-run: build the recipe's own layout (its parallel section, e.g. a zero: 3 "
                        "cluster recipe) instead of the recommended one")
    p.add_argument("--rank", type=int, action="append", default=None, metavar="R", dest="ranks",
                   help="rank(s) to dry-run (repeatable; default: 0 and the last rank)")
    return p


def default_devices_per_node(device_name: str, world: int = 1) -> int:
    """Devices per node: the time model's table (8 GPUs; 16 Trainium chips); for ``cpu`` the whole
    world, because ``plait train --nproc N`` starts every rank on this host."""
    from plait.plan.timing import DEVICES_PER_NODE

    if device_name == "cpu":
        return world
    return DEVICES_PER_NODE.get(device_name, 8)


def check_options(args) -> None:
    """Reject option values no plan can use, naming the option, the value and what is valid
    (argparse accepts ``nan``, ``inf`` and negative numbers for these)."""
    if not 1 <= args.world <= MAX_DEVICES:
        raise ValueError(f"--world={args.world} must be a positive integer of at most {MAX_DEVICES} devices")
    for name in ("top", "unfit"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= 0")
    if args.memory is not None and not (math.isfinite(args.memory) and args.memory > 0):
        raise ValueError(f"--memory={args.memory} is not valid: give the memory per device as a finite number of "
                         f"GB above 0 (e.g. --memory 80)")
    if not (math.isfinite(args.headroom) and 0 <= args.headroom < 1):
        raise ValueError(f"--headroom={args.headroom} is not valid: give a share of memory in [0, 1) (e.g. 0.1)")
    for option, value in (("--nodes-of", args.nodes_of), ("--global-batch", args.global_batch),
                          ("--microbatches", args.microbatches)):
        if value is not None and value < 1:
            raise ValueError(f"{option}={value} must be a positive integer")
    if args.nodes_of is not None and args.nodes_of > MAX_DEVICES:
        raise ValueError(f"--nodes-of={args.nodes_of} must be at most {MAX_DEVICES} devices per node")
    if args.microbatches is not None and args.global_batch is not None:
        raise ValueError("give --global-batch or --microbatches, not both")
    if args.ranks and not args.dry_run:
        raise ValueError(f"--rank {args.ranks[0]} chooses the ranks of a dry run: add --dry-run, or drop --rank")
    bad = [r for r in args.ranks or () if not 0 <= r < args.world]
    if bad:  # before the search, not after the table
        raise ValueError(f"--rank {bad[0]} is outside the world: valid 0..{args.world - 1}")


def cpu_rank_resources(spec, ranks_per_host: int, precision: str) -> tuple[int | None, float]:
    """``(memory bytes, peak FLOP/s)`` of one rank when ``ranks_per_host`` ranks share this host:
    its RAM divided among them, and the matmul probe run with the threads ``plait train`` gives
    each rank (the host's cores divided among them)."""
    from plait.devices import peak_flops

    memory = None if spec.memory_bytes is None else spec.memory_bytes // ranks_per_host
    threads = max(1, (os.cpu_count() or 1) // ranks_per_host)
    return memory, peak_flops(spec, "fp32" if precision == "fp32" else "bf16", threads)


def load_plan_inputs(recipe_path: str, overrides: list[str]):
    """``(recipe, llama config)``: the recipe type-checked and its model validated. The parallel
    section is not checked (the planner chooses it)."""
    from plait.config import load_recipe, recipe_data, validate_recipe

    recipe = load_recipe(recipe_path, overrides)
    # what the recipe wrote, not every field filled in: a model.hf_path recipe names no architecture
    data = recipe_data(recipe_path, overrides)
    data["parallel"] = {}
    data.setdefault("data", {})["global_batch_size"] = None
    data["precision"] = {}  # --precision may plan another preset than the recipe's
    resolved = validate_recipe(data, 1, check_paths=False)
    return recipe, resolved.model_config()


def activation_phase(mem) -> int:
    """Everything at the activation peak besides model states: saved activations, autocast weight
    copies, logits, p2p and TP buffers, workspace. (The total is the larger of this phase plus the
    gradients alive then, and the optimizer-step phase; the columns need not add up to it.)"""
    return mem.activations + mem.weight_copies + mem.logits + mem.comm_buffers + mem.workspace


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def layout_label(layout) -> str:
    label = layout.short()
    if layout.pp > 1 and layout.schedule == "gpipe":
        label += " gpipe"
    return label


def _pareto(candidates) -> list:
    """The candidates (fastest first) that no other one beats on memory without being slower."""
    out, least = [], None
    for c in candidates:
        if least is None or c.memory.total < least:
            out.append(c)
            least = c.memory.total
    return out


def table_rows(plan, top: int, unfit: int = 3, every: bool = False) -> list[int]:
    """Indices (into ``plan.candidates``, fastest first) of the rows to show: the ``top`` fastest
    layouts that fit and the ``unfit`` fastest that do not, among those faster than the
    recommendation (when nothing fits: the ``top`` fastest overall). Unless ``every``, a layout is
    left out when a faster one (or an equally fast one listed before it) needs no more memory."""
    pick = (lambda cs: cs) if every else _pareto
    index = {id(c): i for i, c in enumerate(plan.candidates)}
    if plan.recommended is None:
        return sorted(index[id(c)] for c in pick(plan.candidates)[:max(top, 0)])
    rec_at = index[id(plan.recommended)]
    fit = pick([c for c in plan.candidates if c.fits])[:max(top, 0)]
    no = pick([c for c in plan.candidates[:rec_at] if not c.fits])[:max(unfit, 0)]
    return sorted({index[id(c)] for c in fit + no} | {rec_at})


def render_table(plan, top: int, unfit: int = 3, every: bool = False) -> str:
    shown = table_rows(plan, top, unfit, every)
    rec = plan.recommended
    header = ["#", "layout", "m", "params", "grads", "optim", "act", "total GiB", "step s", "MFU", "fits"]
    body = []
    for i in shown:
        c = plan.candidates[i]
        mem, t = c.memory, c.time
        mark = "yes" if c.fits else "no"
        if c is rec:
            mark += " *"
        body.append([str(i + 1), layout_label(c.layout), str(c.microbatches), _gib(mem.parameters),
                     _gib(mem.gradients), _gib(mem.optimizer + mem.master_weights), _gib(activation_phase(mem)),
                     _gib(mem.total), f"{t.total_s:.2f}", f"{100 * t.mfu:.1f}%", mark])
    widths = [max(len(r[k]) for r in [header] + body) for k in range(len(header))]
    left = {1}

    def fmt(r):
        cells = enumerate(zip(r, widths, strict=True))
        return "  ".join(v.ljust(w) if k in left else v.rjust(w) for k, (v, w) in cells).rstrip()

    lines = [fmt(header)]
    lines.extend(fmt(r) for r in body)
    return "\n".join(lines)


def recipe_overrides(candidate) -> str:
    lay = candidate.layout
    items = [f"parallel.tp={lay.tp}", f"parallel.pp={lay.pp}", f"parallel.dp={lay.dp}"]
    if lay.cp > 1:
        items.append(f"parallel.cp={lay.cp}")
    if lay.ep > 1 or candidate.memory.expert_parameter_count:  # an MoE model: set ep even when 1
        items.append(f"parallel.ep={lay.ep}")
    # also at pp = 1: a recipe written for an interleaved pipeline would otherwise keep its vpp
    items += [f"parallel.vpp={lay.vpp}", f"parallel.schedule={lay.schedule}"]
    items += [f"parallel.microbatches={candidate.microbatches}", f"parallel.kv_replication={lay.kv_replication}",
              f"parallel.sequence_parallel={'true' if lay.sequence_parallel else 'false'}",
              f"parallel.zero={lay.zero}", f"parallel.offload_optimizer={'true' if lay.offload else 'false'}"]
    ckpt = {"none": "off"}.get(lay.activation_checkpointing, lay.activation_checkpointing)
    items.append(f"train.activation_checkpointing={ckpt}")
    return " ".join(items)


def moe_line(candidate, precision: str) -> str:
    """The MoE terms of a candidate: its experts per rank, where their optimizer state is sharded,
    and the all-to-all volume."""
    from plait.plan.memory import precision_bytes

    lay, mem, t = candidate.layout, candidate.memory, candidate.time
    pb = precision_bytes(precision)
    experts = mem.expert_parameter_count
    dense = mem.parameter_count - experts
    shard = lay.dp // lay.ep if lay.zero and lay.dp > 1 else 1
    text = (f"  experts: ep={lay.ep}, {_count(experts)} expert + {_count(dense)} dense parameters per rank "
            f"({experts * pb.param / GiB:.1f} + {dense * pb.param / GiB:.1f} GiB)")
    if lay.zero and lay.dp > 1 and lay.ep > 1:
        text += f"; ZeRO-{lay.zero} shards expert states over dp/ep={shard}, dense over dp={lay.dp}"
    elif lay.zero and lay.dp > 1:
        text += f"; ZeRO-{lay.zero} shards all states over dp={lay.dp}"
    if lay.ep > 1:
        text += f"; all-to-all {t.ep_bytes / 1e9:.1f} GB sent per rank per step"
    return text


def _count(n: float) -> str:
    """A parameter count the way people say it: ``7.24B``, ``3.6M``, ``850K``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def render_plan(plan, config, recipe_name: str, top: int, unfit: int = 3, every: bool = False) -> str:
    n_params = config.num_parameters()
    spec = plan.device
    g = plan.candidates[0].global_batch_size if plan.candidates else 0
    same_batch = len({c.global_batch_size for c in plan.candidates}) == 1
    batch = (f"global batch {g} sequences x {plan.seq_len} tokens ({g * plan.seq_len / 1e6:.1f}M tokens/step)"
             if same_batch else f"{plan.candidates[0].microbatches} micro-batches per DP rank (global batch varies "
                                f"with dp; ranked by time per sequence)")
    lines = [
        f"plan: {recipe_name} ({_count(n_params)} parameters) on {plan.world} x {spec.name} "
        f"({plan.memory_bytes / 1e9:.1f} GB, {plan.devices_per_node} per node); budget "
        f"{plan.budget_bytes / GiB:.1f} GiB per rank after {plan.headroom:.0%} headroom",
        f"{batch}, micro-batch {plan.micro_batch_size}, precision {plan.precision}",
        f"{len(plan.candidates)} layouts, {len(plan.fitting)} fit. Fastest first; # = rank among all "
        f"{len(plan.candidates)}" + ("" if every else "; a layout that a faster one beats on memory is left out "
                                                       "(--all lists it)") + ".",
        "GiB per rank, peak over pipeline ranks: optim = optimizer states + master weights, act = activations "
        "and buffers; * = recommended.",
        render_table(plan, top, unfit, every),
    ]
    rec = plan.recommended
    if rec is None:
        lines.append("recommended: none fits")
    else:
        t = rec.time
        lines += [
            f"recommended: {layout_label(rec.layout)}, {rec.microbatches} micro-batches: {t.total_s:.2f} s/step, "
            f"MFU {100 * t.mfu:.1f}%, {rec.memory.total / GiB:.1f} GiB per rank "
            f"(compute {t.compute_s:.2f} s, TP comm {t.tp_comm_s:.2f} s, DP comm {t.dp_comm_s:.2f} s, "
            f"PP comm {t.pp_comm_s:.2f} s, bubble {100 * t.bubble_share:.1f}%"
            + (f", CP ring {t.cp_comm_s:.2f} s of which {t.cp_exposed_s:.2f} s exposed" if rec.layout.cp > 1 else "")
            + (f", EP all-to-all {t.ep_comm_s:.2f} s" if rec.layout.ep > 1 else "")
            + ")",
        ]
        if rec.memory.expert_parameter_count:
            lines.append(moe_line(rec, plan.precision))
        lines.append(f"  recipe overrides: {recipe_overrides(rec)}")
    return "\n".join(lines)


def run(args) -> int:
    from plait.config import RecipeError
    from plait.config.host_memory import adapter_plan
    from plait.models.errors import ModelConfigError
    from plait.plan.search import PlanError, SearchOptions, rank_layouts, resolve_device

    def fail(message: str) -> int:
        print(f"plait plan: {' '.join(str(message).split())}", file=sys.stderr)
        return 2

    try:
        overrides = []
        for item in args.items:
            if "=" not in item:
                raise ValueError(f"{item!r} is not of the form section.field=value (the recipe file comes first)")
            overrides.append(item)
        check_options(args)
        recipe, config = load_plan_inputs(args.recipe, overrides)
        spec = resolve_device(args.device)
        per_node = args.nodes_of if args.nodes_of is not None else default_devices_per_node(spec.name, args.world)
        global_batch = args.global_batch
        if global_batch is None and args.microbatches is None:
            global_batch = recipe.data.global_batch_size
        precision = args.precision or recipe.precision.preset
        # the recipe's split method; manual cuts fix one stage count, so layouts use the balanced split
        method = "balanced" if recipe.parallel.partition == "manual" else recipe.parallel.partition
        memory = None if args.memory is None else int(args.memory * 1e9)
        peak = None
        if spec.name == "cpu":
            host_memory, peak = cpu_rank_resources(spec, min(per_node, args.world), precision)
            memory = host_memory if memory is None else memory
        plan = rank_layouts(config, args.world, spec, devices_per_node=per_node, peak=peak,
                            micro_batch_size=recipe.data.micro_batch_size, seq_len=recipe.data.seq_len,
                            microbatches=args.microbatches, global_batch_size=global_batch, precision=precision,
                            memory_bytes=memory, headroom=args.headroom, adapters=adapter_plan(recipe),
                            options=SearchOptions(kv_placement=recipe.parallel.kv_placement, partition=method,
                                                  partition_cost=recipe.parallel.partition_cost,
                                                  try_zero1=not args.no_zero1,
                                                  offload=(False, True) if args.offload else (False,),
                                                  # a capacity factor is refused with sequence parallelism
                                                  moe_sequence_parallel=recipe.moe.capacity_factor is None,
                                                  activation_checkpointing=("none",) if args.no_checkpointing
                                                  else ("none", "full")))
    except RecipeError as e:
        return fail(f"the recipe has problems: {'; '.join(str(p) for p in e.problems)}")
    except (PlanError, ModelConfigError, ValueError) as e:
        return fail(str(e))
    print(render_plan(plan, config, recipe.run.name, args.top, args.unfit, args.every), flush=True)
    if not args.dry_run:
        return 0

    from plait.plan.dry_run import dry_run

    rec = plan.recommended
    assert rec is not None, "rank_layouts raises PlanError when no layout fits (require_fit)"
    if args.recipe_layout:
        import dataclasses

        from plait.config import check_recipe
        from plait.config.host_memory import recipe_layout

        try:
            resolved = check_recipe(args.recipe, overrides, world_size=args.world, check_paths=False)
        except RecipeError as e:
            return fail(f"the recipe's layout on {args.world} ranks has problems: "
                        f"{'; '.join(str(p) for p in e.problems)}")
        mine = recipe_layout(resolved)
        m = resolved.recipe.parallel.microbatches
        rec = next((c for c in plan.candidates if c.layout == mine and c.microbatches == m),
                   dataclasses.replace(rec, layout=mine, microbatches=m))
    ranks = args.ranks if args.ranks else sorted({0, args.world - 1})
    bad = [r for r in ranks if not 0 <= r < args.world]
    if bad:
        return fail(f"--rank {bad[0]} is outside the world: valid 0..{args.world - 1}")
    p = recipe.parallel
    stage_layers = None
    if rec.layout.pp > 1:
        from plait.plan.pipeline_split import plan_partition

        try:
            stage_layers = plan_partition(config, rec.layout.pp * rec.layout.vpp, recipe.data.seq_len,
                                          method=method, cost=p.partition_cost).stage_layers()
        except ValueError as e:
            return fail(f"dry run: pipeline split: {e}")
    print(f"dry run of {layout_label(rec.layout)} on {args.world} fake ranks (meta device, no data):", flush=True)
    ok = True
    for r in ranks:
        try:
            report = dry_run(config, rec.layout, args.world, r, precision=precision,
                             micro_batch_size=recipe.data.micro_batch_size, seq_len=recipe.data.seq_len,
                             microbatches=rec.microbatches, partition=method, partition_cost=p.partition_cost,
                             kv_placement=p.kv_placement, stage_layers=stage_layers)
        except (PlanError, ValueError) as e:
            return fail(f"dry run of rank {r}: {e}")
        ok = ok and report.matches and (not report.zero_built or report.zero_matches)
        print("  " + report.check_line(), flush=True)
        if report.zero_built:
            print(report.zero_line(), flush=True)
    print("dry run: parameter (and sharded state) bytes match the memory model" if ok
          else "dry run: parameter (or sharded state) bytes DIFFER from the memory model", flush=True)
    return 0 if ok else 1
