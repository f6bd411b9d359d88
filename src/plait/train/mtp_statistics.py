"""Multi-token prediction as a loop plug-in: the MTP loss of each logging interval, logged apart
from the next-token loss (DeepSeek-V3's prediction modules, :mod:`plait.models.deepseek_v3.model`).

The stages holding the prediction modules (the last pipeline stage) collect device-side sums of
each depth's cross-entropy and counted targets (:class:`~plait.models.deepseek_v3.model.MtpStats`);
at each logging step every rank takes part in one gather of them (also ranks holding none), and
the interval's ``mtp_loss`` is the mean over the depths of each depth's token-mean loss, whatever
the layout (TP ranks count the same tokens alike, which changes no ratio).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.models.deepseek_v3.model import MtpStats
from plait.train.plugins import StepPlugin


def attach_mtp_stats(stages: list[nn.Module], depths: int) -> list[nn.Module]:
    """Give every stage that runs prediction modules a zeroed :class:`MtpStats`; returns those stages."""
    holders = [s for s in stages if hasattr(s, "mtp_stats") and len(getattr(s, "mtp", ())) > 0]
    for stage in holders:
        setattr(stage, "mtp_stats", MtpStats.zeros(depths, next(stage.parameters()).device))  # noqa: B010 (a stage is any Module)
    return holders


class MtpStatistics(StepPlugin):
    """``stages``: this rank's; ``depths``: the model's prediction modules; ``control``/``world``: the
    group every rank gathers over."""

    def __init__(self, stages: list[nn.Module], depths: int, control: dist.ProcessGroup | None, world: int) -> None:
        self.holders = attach_mtp_stats(stages, depths)
        self.depths, self.control, self.world = depths, control, world

    def interval_metrics(self, step: int) -> dict[str, float]:
        local: list[float] = [0.0] * (2 * self.depths)
        for stage in self.holders:
            s = stage.mtp_stats
            assert isinstance(s, MtpStats)
            sums = torch.cat([s.loss_sum, s.targets]).tolist()  # the one host read
            local = [a + b for a, b in zip(local, sums, strict=True)]
            setattr(stage, "mtp_stats", MtpStats.zeros(self.depths, s.loss_sum.device))  # noqa: B010
        parts: list[list[float] | None] = [local]
        if self.world > 1:
            parts = [None] * self.world
            dist.all_gather_object(parts, local, group=self.control)
        total = [sum(p[i] for p in parts if p is not None) for i in range(2 * self.depths)]
        losses, targets = total[:self.depths], total[self.depths:]
        if not any(targets):
            return {}
        per_depth = [loss / max(count, 1.0) for loss, count in zip(losses, targets, strict=True)]
        metrics = {"mtp_loss": sum(per_depth) / self.depths}
        if self.depths > 1:
            metrics.update({f"mtp_loss/depth{k}": v for k, v in enumerate(per_depth, start=1)})
        return metrics


__all__ = ["MtpStatistics", "attach_mtp_stats"]
