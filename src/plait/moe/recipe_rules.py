"""The recipe rules of Mixture-of-Experts training, checked before any process starts.

:func:`moe_problems` returns ``(field, value, what is valid)`` triples; the recipe checker
(:mod:`plait.config.rules`) reports them with every other problem. The architecture's own rules
(``num_experts_per_tok`` above the expert count, MoE keys on a dense family) are the family
configs' (:mod:`plait.models.mixtral.config`), reported under the field they name.
"""

from __future__ import annotations

from typing import Any

from plait.moe.section import MoeSection

Problem = tuple[str, Any, str]


def is_moe_config(config: Any) -> bool:
    """Whether a model config (any family) has MoE layers."""
    return callable(getattr(config, "moe_layer_ids", None)) and bool(config.moe_layer_ids())


def num_experts(config: Any) -> int:
    """Experts per MoE layer of a config of either MoE family."""
    return int(getattr(config, "num_local_experts", None) or config.num_experts)


def moe_problems(moe: MoeSection, arch: Any, family: str, *, tp: int, parallel: Any = None,
                 dp: int | None = None) -> list[Problem]:
    """Problems of the ``moe`` section and the layout (``parallel``, its derived ``dp``) for
    architecture ``arch`` (``None`` when the architecture is itself broken: only the section's own
    rules run)."""
    out: list[Problem] = []
    ep = getattr(parallel, "ep", 1)
    if ep > 1 and dp is not None and dp % ep:
        valid = [e for e in range(1, dp + 1) if dp % e == 0]
        out.append(("parallel.ep", ep, f"must divide the data-parallel degree dp={dp} (expert parallelism folds "
                                       f"over data parallelism); valid: {valid}"))
    if ep > 1 and getattr(parallel, "cp", 1) > 1:
        out.append(("parallel.ep", ep, f"expert parallelism with context parallelism (parallel.cp={parallel.cp}) "
                                       f"is not available yet; set parallel.ep=1 or parallel.cp=1"))
    cf = moe.capacity_factor
    if cf is not None and cf <= 0:
        out.append(("moe.capacity_factor", cf, "must be > 0 (e.g. 1.25: each expert accepts 1.25x its balanced "
                                               "share), or null for dropless routing"))
    if moe.router != "sigmoid":
        default = MoeSection()
        for key in ("router_bias_update_rate", "router_groups", "router_topk_groups"):
            if getattr(moe, key) != getattr(default, key):
                router = ("moe.router is not set: the family's softmax router" if moe.router is None
                          else f"moe.router={moe.router!r}")
                out.append((f"moe.{key}", getattr(moe, key), f"only the sigmoid router uses it ({router}); set "
                                                              f"moe.router: sigmoid or remove moe.{key}"))
    if moe.router_topk_groups > moe.router_groups:
        out.append(("moe.router_topk_groups", moe.router_topk_groups,
                    f"must be <= moe.router_groups={moe.router_groups}"))
    if arch is None:
        return out
    if not is_moe_config(arch):
        if ep > 1:
            out.append(("parallel.ep", ep, f"model.family={family!r} has no experts to split; set parallel.ep=1"))
        if moe.changed():
            keys = ", ".join(f"moe.{k}" for k in moe.changed())
            out.append(("moe", keys, f"model.family={family!r} has no experts; remove the moe section or choose "
                                     f"an MoE family (mixtral, qwen3_moe)"))
        return out
    experts = num_experts(arch)
    if ep > 1 and experts % ep:
        valid = [e for e in range(1, experts + 1) if experts % e == 0]
        out.append(("parallel.ep", ep, f"must divide the {experts} experts of each MoE layer; valid: {valid}"))
    groups = moe.router_groups
    if experts % groups:
        valid = [g for g in range(1, experts + 1) if experts % g == 0]
        out.append(("moe.router_groups", groups, f"must divide the {experts} experts of each MoE layer; "
                                                 f"valid: {valid}"))
    elif moe.router_topk_groups <= groups and moe.router_topk_groups * (experts // groups) < arch.num_experts_per_tok:
        out.append(("moe.router_topk_groups", moe.router_topk_groups,
                    f"its groups hold {moe.router_topk_groups * (experts // groups)} experts, fewer than "
                    f"model.num_experts_per_tok={arch.num_experts_per_tok}; raise it"))
    if tp > 1 and getattr(parallel, "sequence_parallel", False) and cf is not None:
        out.append(("moe.capacity_factor", cf, f"is not available with parallel.sequence_parallel=true and "
                                               f"parallel.tp={tp}: each TP rank would drop assignments by its "
                                               f"sequence shard's ranking, not the micro-batch's; set "
                                               f"moe.capacity_factor=null (dropless) or "
                                               f"parallel.sequence_parallel=false"))
    return out
