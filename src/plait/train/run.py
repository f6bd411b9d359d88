"""Everything one rank's training run uses, as one typed object made by
:func:`plait.train.build_run.build_run`: the :class:`~plait.train.run_state.RunState` (model,
optimizer, data, objective and plug-ins), and what the loop drives it with."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from plait.data.batch import TokenBatch
from plait.train.agreement import StopSignals
from plait.train.checkpointing import RunCheckpoints
from plait.train.host_syncs import HostSyncDetector
from plait.train.loggers import MultiSink
from plait.train.plugins import FinalExport
from plait.train.run_state import RunState
from plait.train.running_metrics import RunningMetrics
from plait.train.watchdog import Watchdog


class BatchSource(Protocol):
    """Where the loop's batches come from: the prepared data's loader (:class:`plait.data.loader.
    BatchLoader`) or GRPO's rollouts (:class:`plait.train.grpo.RolloutLoader`)."""

    #: seconds the loop has waited for a batch so far
    wait_seconds: float

    def __iter__(self) -> Iterator[torch.Tensor | TokenBatch]: ...

    def __next__(self) -> torch.Tensor | TokenBatch: ...

    def close(self) -> None: ...


@dataclass
class Run:
    """One rank's run. ``sinks`` exist on the writing rank (global rank 0) only."""

    state: RunState
    #: this rank's batches from ``state.start_step`` on (built ahead by a background thread, or
    #: sampled from the policy by GRPO's rollouts)
    loader: BatchSource
    checkpoints: RunCheckpoints
    #: the final model's writer (full Hugging Face model or LoRA adapter)
    export: FinalExport
    #: dumps every rank's stacks and names the collective when a phase stalls
    watchdog: Watchdog
    #: SIGTERM/SIGINT of any rank, agreed by all
    signals: StopSignals
    metrics: RunningMetrics
    sinks: MultiSink | None
    #: counts device-to-host reads in the first steps (``train.detect_host_syncs``; 0 steps: off)
    host_syncs: HostSyncDetector
    #: the device's peak FLOP/s (measured once on rank 0, shared) and the model's FLOPs per token
    peak_flops: float
    flops_per_token: float
    #: where rank 0 writes the run's outputs
    out: Path

    @property
    def is_writer(self) -> bool:
        return self.state.rank == 0
