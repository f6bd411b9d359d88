"""Elastic resize: the same recipe on a world that grew or shrank between restarts.

Under ``torchrun --nnodes MIN:MAX`` a lost host makes the survivors restart at a smaller world
size (and a returning host makes the next restart grow it). plait lets exactly one degree follow
the world size: data parallelism, derived when ``parallel.dp`` is null. Tensor, pipeline and
context parallelism are fixed (they split the model; the checkpoint reshards across them, but a
world that does not fit them is refused). The global batch is kept: when the recipe fixes
``data.global_batch_size``, the micro-batches per step are re-derived so that
``micro_batch_size * microbatches * dp`` still equals it, and the loss trajectory continues as if
nothing happened (the data order depends on the global batch only).
"""

from __future__ import annotations

import copy
from typing import Any

from plait.config.schema import DataSection, ParallelSection


class ResizeError(ValueError):
    """The world size cannot host the recipe by changing the data-parallel degree alone."""


def _degree(section: dict[str, Any], name: str) -> int:
    value = section.get(name, 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def fit_to_world(data: dict[str, Any], world: int) -> tuple[dict[str, Any], str | None]:
    """``(data, note)``: raw recipe data adjusted for ``world`` processes, and what changed (or ``None``).

    Only recipes with ``parallel.dp`` null are adjusted; anything else is left to validation,
    whose messages name the fields. Raises :class:`ResizeError` when ``world`` is not a multiple
    of ``tp * pp * cp``, or when the global batch cannot be kept at the new ``dp``.
    """
    parallel = data.get("parallel") or {}
    batch = data.get("data") or {}
    if not isinstance(parallel, dict) or not isinstance(batch, dict) or parallel.get("dp") is not None:
        return data, None
    tp, pp, cp = _degree(parallel, "tp"), _degree(parallel, "pp"), _degree(parallel, "cp")
    fixed = tp * pp * cp
    if world % fixed:
        raise ResizeError(f"the world has {world} processes, not a multiple of tp*pp*cp = {tp}*{pp}*{cp} = {fixed}; "
                          f"a resize changes only the data-parallel degree (tp, pp and cp are fixed): give every "
                          f"host a multiple of {fixed} ranks, or restart with a world that fits them")
    dp = world // fixed
    gbs = batch.get("global_batch_size")
    if not isinstance(gbs, int) or isinstance(gbs, bool):
        return data, None
    mbs = batch.get("micro_batch_size", DataSection.model_fields["micro_batch_size"].default)
    microbatches = parallel.get("microbatches", ParallelSection.model_fields["microbatches"].default)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (mbs, microbatches)):
        return data, None  # validation names the bad field
    if mbs * microbatches * dp == gbs:
        return data, None
    if gbs % (mbs * dp):
        raise ResizeError(f"data.global_batch_size={gbs} cannot be kept at dp={dp} (world {world}): it is not a "
                          f"multiple of micro_batch_size*dp = {mbs}*{dp}; choose a global batch divisible by "
                          f"micro_batch_size times every dp the job may run at")
    fitted = copy.deepcopy(data)
    fitted.setdefault("parallel", {})["microbatches"] = gbs // (mbs * dp)
    note = (f"dp={dp} at world size {world}: parallel.microbatches {microbatches} -> {gbs // (mbs * dp)} keeps "
            f"data.global_batch_size={gbs}")
    return fitted, note
