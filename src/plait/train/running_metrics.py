"""Per-interval training metrics that stay on the device until the logging step.

Adding a step's loss and gradient norm is a device-side addition; the host reads the sums once
per logging interval (one ``tolist()``), so steps that do not log never wait for the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RunningMetrics:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, grad norm
        self.steps = 0

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self._sums += torch.stack([loss.detach().double(), grad_norm.detach().double()])
        self.steps += 1

    def read(self, average_over=None, loss_from=None) -> dict[str, float]:
        """Means over the interval, then reset.

        ``loss_from``: the pipeline group, whose last stage alone holds the loss (the others add
        zero); ``average_over``: the data-parallel group, whose ranks' values are averaged.
        """
        sums = self._sums
        if loss_from is not None and loss_from.size > 1:
            sums = sums.clone()
            loss = sums[:1].clone()
            dist.all_reduce(loss, group=loss_from.group)
            sums[0] = loss[0]
        if average_over is not None and average_over.size > 1:
            sums = sums.clone()
            dist.all_reduce(sums, group=average_over.group)
            sums[0] /= average_over.size
            sums[1] /= average_over.size
        loss, grad_norm = (sums / max(self.steps, 1)).tolist()
        self._sums = torch.zeros_like(self._sums)
        self.steps = 0
        return {"loss": loss, "grad_norm": grad_norm}
