"""MoE as a loop plug-in: the step's expert load (global-batch aux loss, sigmoid router biases),
the per-layer statistics of each logging interval, and the expert load map of the run.

The load balancing itself is :mod:`plait.moe.step_load`; this object only calls it at the step
boundaries and reads :func:`plait.moe.read_moe_stats` at each logging step (a collective of
every rank, also of ranks whose stages hold no MoE layer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.moe import moe_layers, read_moe_stats
from plait.moe.load_map import MOE_LOAD_FILE, append_load, plot_load_map
from plait.moe.step_load import LoadBalancing
from plait.train.plugins import StepPlugin


class MoeStatistics(StepPlugin):
    """``load_balancing``: this rank's step hooks (``None`` when no layer here needs them);
    ``load_file``: where the writing rank appends the per-expert shares (``None``: another rank);
    ``plot``: draw the load map at the end; ``steps``: ``train.steps``, the map's last step when
    the run's final step is unknown."""

    def __init__(self, stages: list[nn.Module], load_balancing: LoadBalancing | None,
                 control: dist.ProcessGroup | None, world: int, load_file: Path | None, *, plot: bool,
                 steps: int) -> None:
        self.layers = moe_layers(stages)
        self.load_balancing, self.control, self.world = load_balancing, control, world
        self.load_file, self.plot, self.steps = load_file, plot, steps

    def start_step(self) -> None:
        if self.load_balancing is not None:
            self.load_balancing.start_step()

    def end_step(self, grad_norm: torch.Tensor) -> None:
        if self.load_balancing is not None:  # after the optimizer step: the sigmoid routers' expert biases
            self.load_balancing.finish_step(grad_norm)

    def interval_metrics(self, step: int) -> dict[str, float]:
        """Per MoE layer, averaged over the ranks holding it; the writing rank logs the load map."""
        stats, loads = read_moe_stats(self.layers, self.control, self.world)
        if self.load_file is not None and loads:
            append_load(self.load_file, step, loads)
        return stats

    def write_outputs(self, out: Path, final: dict[str, Any]) -> None:
        if self.plot and (out / MOE_LOAD_FILE).exists():  # expert load heat map of an MoE run
            plot_load_map(out / MOE_LOAD_FILE, out / "moe_load.png", final.get("final_step", self.steps))
