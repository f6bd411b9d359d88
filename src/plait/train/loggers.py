"""Where training metrics go: a JSON-lines file, TensorBoard, a progress bar, or all of them.

Every sink takes ``log(step, metrics)`` with ``metrics`` a flat ``{name: number}`` dict, so the
trainer computes each number once and the sinks only format it. ``step`` is the number of
optimizer steps completed (1 after the first step). Only the ranks that should write create
file sinks; :func:`default_sinks` does that choice for a run directory.

Metric names are listed in ``docs/metrics.md`` (``loss``, ``lr``, ``grad_norm``,
``tokens_per_s``, ``mfu``, ``val_loss``, ...).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm.auto import tqdm

from plait.tracking.metric_names import grouped_scalars
from plait.tracking.sink import MetricsSink


def _number(value: Any) -> Any:
    """A plain Python number from a tensor / numpy scalar / number (other values pass through)."""
    if hasattr(value, "item"):
        value = value.item()
    return value


class JsonlSink(MetricsSink):
    """One JSON object per ``log`` call, ``{"step": ..., "time": <unix s>, **metrics}``, flushed each write.

    Non-finite values are written as ``NaN`` / ``Infinity`` (Python's ``json`` reads them back).
    ``append=True`` keeps an existing file (a resumed run); otherwise it is truncated.
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record: dict[str, Any] = {"step": int(step), "time": round(time.time(), 3)}
        record.update({k: _number(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def keep_metrics_through(path: str | os.PathLike, step: int) -> int:
    """Rewrite a ``metrics.jsonl`` keeping the records of steps ``<= step``; returns how many were dropped.

    A run resumed from the checkpoint of ``step`` trains the later steps again; their records
    from the interrupted attempt (and a partial last line) would otherwise appear twice in the
    curve. The file is replaced atomically, so a crash here leaves the old one.
    """
    path = Path(path)
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += bool(line.strip())
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            dropped += 1
            continue
        kept.append(line + "\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


class TensorBoardSink(MetricsSink):
    """Each numeric metric becomes a TensorBoard scalar tagged with its grouped name (``train/loss``,
    ``val/loss``, ``perf/tokens_per_s``: :mod:`plait.tracking.metric_names`), as in W&B and MLflow."""

    def __init__(self, logdir: str | os.PathLike, *, flush_secs: int = 30) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: slow, and optional for users

        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=flush_secs)
        self._closed = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in grouped_scalars(metrics).items():
            self._writer.add_scalar(name, value, global_step=int(step))

    def flush(self) -> None:
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.2e}"


class ProgressSink(MetricsSink):
    """A tqdm bar over ``total_steps`` showing loss, lr and tokens/s of the latest step.

    ``enabled=None`` shows the bar on global rank 0 only (every rank when not distributed).
    """

    _POSTFIX = (("loss", "loss"), ("val_loss", "val"), ("lr", "lr"), ("tokens_per_s", "tok/s"), ("mfu", "mfu"))

    def __init__(self, total_steps: int, enabled: bool | None = None, *, initial: int = 0,
                 file: TextIO | None = None) -> None:
        if enabled is None:
            enabled = _global_rank() == 0
        self.enabled = enabled
        self._bar = tqdm(total=total_steps, initial=initial, disable=not enabled, dynamic_ncols=True,
                         unit="step", file=file if file is not None else sys.stderr)
        self._postfix: dict[str, str] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        for key, label in self._POSTFIX:
            if key in metrics:
                value = float(_number(metrics[key]))
                self._postfix[label] = f"{value:.1%}" if key == "mfu" else _fmt(value)
        self._bar.set_postfix(self._postfix, refresh=False)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        else:
            self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


class MultiSink(MetricsSink):
    """Forwards every call to each sink; ``close`` closes all of them even if one fails."""

    def __init__(self, sinks: Iterable[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - close the others, then re-raise the first
                error = error or e
        if error is not None:
            raise error


def default_sinks(run_dir: str | os.PathLike, total_steps: int, *, rank: int | None = None,
                  tensorboard: bool = True, progress: bool = True, append: bool = False) -> MultiSink:
    """The usual sinks of a run: on rank 0 ``run_dir/metrics.jsonl``, ``run_dir/tensorboard/`` and a bar;
    nothing on other ranks (``rank=None`` reads the global rank)."""
    rank = _global_rank() if rank is None else rank
    if rank != 0:
        return MultiSink([])
    run_dir = Path(run_dir)
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl", append=append)]
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if progress:
        sinks.append(ProgressSink(total_steps, enabled=True))
    return MultiSink(sinks)


def _global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def peak_memory_bytes(device: str | torch.device = "cpu") -> int:
    """Peak memory of this process on ``device``: CUDA ``max_memory_allocated``, else peak RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


__all__ = ["JsonlSink", "MetricsSink", "MultiSink", "ProgressSink", "TensorBoardSink", "default_sinks",
           "keep_metrics_through", "peak_memory_bytes"]
