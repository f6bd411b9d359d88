"""Every rank agreeing on a host number at a step boundary (a stop signal, the slowest compile).

Over the run's gloo ``control`` group, which never touches the accelerator, and timed by the
stall watchdog so that a rank that never arrives is reported instead of hanging the others.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from plait.train.watchdog import Watchdog


class RankAgreement:
    """``control``: the run's host-side group (``None`` in one process: every value is agreed)."""

    def __init__(self, control: dist.ProcessGroup | None, watchdog: Watchdog) -> None:
        self.control, self.watchdog = control, watchdog

    def maximum(self, value: float, what: str, dtype: torch.dtype = torch.float64) -> float:
        """The largest of every rank's ``value``; ``what`` names the collective for the watchdog."""
        if self.control is None:
            return value
        t = torch.tensor([value], dtype=dtype)
        with self.watchdog.watch(what, "all ranks"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return float(t[0]) if dtype.is_floating_point else int(t[0])


class StopSignals:
    """SIGTERM/SIGINT received by any rank, agreed by all at a step boundary.

    The first signal is kept: Ctrl-C's SIGINT reaches the workers before the launcher forwards its
    SIGTERM, and the user's is the one to report.
    """

    def __init__(self, agreement: RankAgreement) -> None:
        self.agreement = agreement
        self.received = 0
        #: the agreed signal once one ended training or its outputs (0: none)
        self.stopped_by = 0

    def install(self) -> None:
        """Catch the signals (only the main thread may install handlers; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 - handler signature
            self.received = self.received or signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)

    def requested(self) -> int:
        """The signal any rank received (0: none); collective."""
        return int(self.agreement.maximum(self.received, "preemption check (all-reduce of the stop flag)",
                                          torch.int64))
