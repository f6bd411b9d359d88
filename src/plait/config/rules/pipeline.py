"""Pipeline parallelism: virtual stages, the schedule against pp and the micro-batches, and the
split of the model into ``pp * vpp`` stages (computed, so a split that cannot be made is refused
before launch)."""

from __future__ import annotations

from plait.config.rules.checker import Checker
from plait.pipeline.partition import PartitionError
from plait.pipeline.schedules import INTERLEAVED_SCHEDULES, ScheduleError, validate_schedule
from plait.plan.pipeline_split import plan_partition


def check_pipeline(c: Checker) -> None:
    p, arch = c.r.parallel, c.arch
    if not c.ok("parallel.pp", "parallel.vpp"):
        return
    if p.vpp > 1 and p.pp == 1:
        c.add("parallel.vpp", p.vpp, "virtual pipeline stages need parallel.pp > 1; use vpp=1")
    if p.pp == 1:
        return
    stages = p.pp * p.vpp
    if arch is not None and arch.num_hidden_layers < stages:
        c.add("model.num_hidden_layers", arch.num_hidden_layers,
              f"fewer decoder layers than pipeline stages pp*vpp = {p.pp}*{p.vpp} = {stages}; every stage "
              f"needs at least one layer: lower parallel.pp or parallel.vpp")
    if not c.ok("parallel.schedule", "parallel.microbatches"):
        return
    if p.vpp > 1 and p.schedule not in INTERLEAVED_SCHEDULES:
        c.add("parallel.schedule", p.schedule, f"vpp={p.vpp} needs an interleaved schedule ('interleaved-1f1b' or "
                                               f"'interleaved-zb'); {p.schedule!r} supports only parallel.vpp=1")
        return
    try:
        validate_schedule(p.schedule, p.pp, p.microbatches, p.vpp)
    except ScheduleError as e:
        c.add("parallel.microbatches", p.microbatches, str(e))
    if not c.ok("parallel.partition", "parallel.partition_cost", "parallel.pipeline_cuts"):
        return
    if p.partition == "manual" and not p.pipeline_cuts:
        c.add("parallel.pipeline_cuts", p.pipeline_cuts, "partition='manual' needs the layers that start "
                                                          f"stages 1..{stages - 1}, e.g. ['model.layers.4']")
        return
    if p.partition != "manual" and p.pipeline_cuts:
        c.add("parallel.pipeline_cuts", p.pipeline_cuts, "cuts are used only with partition='manual'")
        return
    if arch is not None and arch.num_hidden_layers >= stages and c.ok("data.seq_len"):
        try:
            plan_partition(arch, stages, c.r.data.seq_len, method=p.partition, cost=p.partition_cost,
                           cuts=p.pipeline_cuts)
        except PartitionError as e:
            c.add("parallel.pipeline_cuts" if p.pipeline_cuts else "parallel.partition",
                  p.pipeline_cuts or p.partition, str(e))
