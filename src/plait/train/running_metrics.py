"""Per-interval training metrics that stay on the device until the logging step.

Adding a step's loss and gradient norm is a device-side addition; the host reads the sums once
per logging interval (one ``tolist()``), so steps that do not log never wait for the device.
With ``skip_nonfinite`` a step whose loss or norm is not finite (its update was skipped) is
counted as skipped instead of poisoning the sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.comm.primitives import GroupInfo


class RunningMetrics:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, grad norm, skipped, non-finite
        self.steps = 0

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor, *, skip_nonfinite: bool = False) -> None:
        values = torch.stack([loss.detach().double(), grad_norm.detach().double()])
        bad = (~torch.isfinite(values).all()).double()
        if skip_nonfinite:
            values = torch.where(bad.bool(), torch.zeros_like(values), values)
            self._sums += torch.cat([values, bad.reshape(1), torch.zeros(1, dtype=torch.float64, device=self.device)])
        else:
            self._sums += torch.cat([values, torch.zeros(1, dtype=torch.float64, device=self.device), bad.reshape(1)])
        self.steps += 1

    def finite(self) -> bool:
        """No step since the last read had a non-finite loss or norm that was not skipped (a host read)."""
        return bool(torch.isfinite(self._sums[:2]).all()) and float(self._sums[3]) == 0

    def read(self, average_over: GroupInfo | None = None, loss_from: GroupInfo | None = None) -> dict[str, float]:
        """Means over the interval's non-skipped steps, then reset.

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
            sums[:4] /= average_over.size
        loss, grad_norm, skipped, _ = sums.tolist()
        counted = self.steps - round(skipped)
        self._sums = torch.zeros_like(self._sums)
        self.steps = 0
        if counted <= 0:  # every step of the interval was skipped
            return {"loss": float("nan"), "grad_norm": float("nan"), "skipped_steps": round(skipped)}
        out = {"loss": loss / counted, "grad_norm": grad_norm / counted}
        if skipped:
            out["skipped_steps"] = round(skipped)
        return out
