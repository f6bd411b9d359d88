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


def moe_problems(moe: MoeSection, arch: Any, family: str, *, tp: int) -> list[Problem]:
    """Problems of the ``moe`` section and the layout for architecture ``arch`` (``None`` when the
    architecture is itself broken: only the section's own rules run)."""
    out: list[Problem] = []
    cf = moe.capacity_factor
    if cf is not None and cf <= 0:
        out.append(("moe.capacity_factor", cf, "must be > 0 (e.g. 1.25: each expert accepts 1.25x its balanced "
                                               "share), or null for dropless routing"))
    if arch is None:
        return out
    if not is_moe_config(arch):
        if moe.changed():
            keys = ", ".join(f"moe.{k}" for k in moe.changed())
            out.append(("moe", keys, f"model.family={family!r} has no experts; remove the moe section or choose "
                                     f"an MoE family (mixtral, qwen3_moe)"))
        return out
    if tp > 1:
        out.append(("parallel.tp", tp, f"tensor parallelism is not available for MoE models (model.family="
                                       f"{family!r}) yet; set parallel.tp=1"))
    return out
