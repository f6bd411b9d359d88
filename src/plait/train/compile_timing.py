"""``train.compile`` as a loop plug-in: compile time reported as ``compile_s`` and kept out of
the throughput of the interval it happened in (the first steps, and any recompilation)."""

from __future__ import annotations

from plait.train.agreement import RankAgreement
from plait.train.compile import compile_seconds
from plait.train.plugins import StepPlugin


class CompileTiming(StepPlugin):
    """The compile seconds of the slowest rank so far: a later pipeline stage's compile stalls
    rank 0 too, so every rank reports and subtracts the slowest one's."""

    def __init__(self, agreement: RankAgreement) -> None:
        self.agreement = agreement
        self.mark = compile_seconds()  # compile time already counted
        self.total = 0.0

    def start_run(self) -> None:
        # what compiled before training (a precomputed reference pass through the compiled stages)
        # is in no interval
        self.mark = compile_seconds()

    def untimed_seconds(self) -> float:
        now = compile_seconds()
        compiled, self.mark = now - self.mark, now
        compiled = self.agreement.maximum(compiled, "compile time (all-reduce of each rank's seconds)")
        self.total += compiled
        return compiled

    def interval_metrics(self, step: int) -> dict[str, float]:
        return {"compile_s": self.total}
