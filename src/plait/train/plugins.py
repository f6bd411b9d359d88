"""The interface between the training loop and what a recipe turns on: objectives, stateful
features and the final model's export.

The loop (:mod:`plait.train.trainer`) knows no feature. It calls, on every rank, the hooks of the
run's :class:`Objective` and of each :class:`StepPlugin` held in the
:class:`~plait.train.run_state.RunState`, and the run's :class:`FinalExport` at the end; a new
objective (GRPO) or feature (ZeRO-3's gathers, a family's statistics) is one more object made by
:func:`plait.train.build_run.build_run`, not one more branch in the loop. Every hook has a no-op
default, so a plugin writes only the hooks it needs.

Collective hooks (``interval_metrics``, ``untimed_seconds``, ``evaluate``, ``export``) are called
on every rank at the same point, so they may communicate; ``write_outputs`` and
``summary_lines`` run on the writing rank (global rank 0) only, after training, and must not.
Because the hooks are collective, every rank holds the same plug-ins in the same order: a
feature is made a plug-in on every rank, also where this rank's stages hold none of its layers
(the MoE statistics of a dense pipeline stage take part in the all-gather with nothing to add).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class StepPlugin:
    """A stateful feature's hooks into the loop (see the module doc for who calls them where)."""

    def start_run(self) -> None:
        """When training starts, after the run is built, resumed and any precomputation is done."""

    def start_step(self) -> None:
        """Before the step's first forward."""

    def end_step(self, grad_norm: torch.Tensor) -> None:
        """After the optimizer step; ``grad_norm`` is the step's (a device tensor: never read it here)."""

    def untimed_seconds(self) -> float:
        """Seconds of the logging interval spent in this feature's own one-off work (compiling),
        left out of the interval's throughput. Collective; read before :meth:`interval_metrics`."""
        return 0.0

    def interval_metrics(self, step: int) -> dict[str, float]:
        """Metrics of the logging interval that ends at ``step`` (collective; the writing rank may
        also append to the feature's own files here)."""
        return {}

    def write_outputs(self, out: Path, final: dict[str, Any]) -> None:
        """The feature's end-of-run files in the output directory (writing rank only)."""

    def summary_lines(self, final: dict[str, Any]) -> list[str]:
        """Lines appended to the run's summary (writing rank only)."""
        return []


class Objective(StepPlugin):
    """A training objective: what the last stage's loss is and how a model is scored on the
    validation split. ``name`` is ``train.objective``'s value."""

    name: str = ""

    def evaluate(self) -> dict[str, float]:
        """Validation metrics of the current model (collective)."""
        raise NotImplementedError


class FinalExport:
    """How the run's final model is written (collective): ``what`` names it in the run's output."""

    what: str = ""

    def export(self, step: int) -> None:
        raise NotImplementedError
