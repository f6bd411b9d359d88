"""Mixture-of-Experts and expert parallelism: the ``moe`` section and the layout against the
architecture (``c.arch is None`` when the architecture is itself broken: only the section's own
rules run). The architecture's own rules (``num_experts_per_tok`` above the expert count, MoE keys
on a dense family) are the family configs' (:mod:`plait.models.mixtral.config`), reported under
the field they name."""

from __future__ import annotations

from typing import Any

from plait.config.rules.checker import Checker
from plait.moe.model_config import is_moe_config, num_experts
from plait.moe.section import MoeSection


def check_moe(c: Checker) -> None:
    if not c.ok("moe", "parallel.tp", "parallel.ep"):
        return
    moe, parallel, dp = c.r.moe, c.r.parallel, c.dp
    arch: Any = c.arch  # an MoE family's config adds the expert fields to its base's
    family = type(arch).family if arch else c.r.model.family
    tp, ep = parallel.tp, parallel.ep
    if ep > 1 and dp is not None and dp % ep:
        valid = [e for e in range(1, dp + 1) if dp % e == 0]
        c.add("parallel.ep", ep, f"must divide the data-parallel degree dp={dp} (expert parallelism folds over "
                                 f"data parallelism); valid: {valid}")
    if ep > 1 and parallel.cp > 1:
        c.add("parallel.ep", ep, f"expert parallelism with context parallelism (parallel.cp={parallel.cp}) is not "
                                 f"available yet; set parallel.ep=1 or parallel.cp=1")
    cf = moe.capacity_factor
    if cf is not None and cf <= 0:
        c.add("moe.capacity_factor", cf, "must be > 0 (e.g. 1.25: each expert accepts 1.25x its balanced share), "
                                         "or null for dropless routing")
    if moe.router != "sigmoid":
        default = MoeSection()
        for key in ("router_bias_update_rate", "router_groups", "router_topk_groups"):
            if getattr(moe, key) != getattr(default, key):
                router = ("moe.router is not set: the family's softmax router" if moe.router is None
                          else f"moe.router={moe.router!r}")
                c.add(f"moe.{key}", getattr(moe, key), f"only the sigmoid router uses it ({router}); set "
                                                       f"moe.router: sigmoid or remove moe.{key}")
    if moe.router_topk_groups > moe.router_groups:
        c.add("moe.router_topk_groups", moe.router_topk_groups, f"must be <= moe.router_groups={moe.router_groups}")
    if arch is None:
        return
    if not is_moe_config(arch):
        if ep > 1:
            c.add("parallel.ep", ep, f"model.family={family!r} has no experts to split; set parallel.ep=1")
        if moe.changed():
            keys = ", ".join(f"moe.{k}" for k in moe.changed())
            c.add("moe", keys, f"model.family={family!r} has no experts; remove the moe section or choose an MoE "
                               f"family (mixtral, qwen3_moe)")
        return
    experts = num_experts(arch)
    if ep > 1 and experts % ep:
        valid = [e for e in range(1, experts + 1) if experts % e == 0]
        c.add("parallel.ep", ep, f"must divide the {experts} experts of each MoE layer; valid: {valid}")
    groups = moe.router_groups
    if experts % groups:
        valid = [g for g in range(1, experts + 1) if experts % g == 0]
        c.add("moe.router_groups", groups, f"must divide the {experts} experts of each MoE layer; valid: {valid}")
    elif moe.router_topk_groups <= groups and moe.router_topk_groups * (experts // groups) < arch.num_experts_per_tok:
        c.add("moe.router_topk_groups", moe.router_topk_groups,
              f"its groups hold {moe.router_topk_groups * (experts // groups)} experts, fewer than "
              f"model.num_experts_per_tok={arch.num_experts_per_tok}; raise it")
    if tp > 1 and parallel.sequence_parallel and cf is not None:
        c.add("moe.capacity_factor", cf, f"is not available with parallel.sequence_parallel=true and "
                                         f"parallel.tp={tp}: each TP rank would drop assignments by its sequence "
                                         f"shard's ranking, not the micro-batch's; set moe.capacity_factor=null "
                                         f"(dropless) or parallel.sequence_parallel=false")
