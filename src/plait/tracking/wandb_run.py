"""Weights & Biases as a metrics destination (``logging.wandb``).

The run is opened with the resolved recipe as its config and logs the trainer's records under
the grouped names (:mod:`plait.tracking.metric_names`) at the optimizer step. W&B's own console
capture is off (plait writes its logs itself, and wrapping the terminal of a multi-process launch
garbles it); plait prints one line saying where the run went instead. A resumed plait run
continues the same W&B run (its id is kept in the run directory).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

import wandb

from plait.tracking.run_ids import read_run_id, record_run_id
from plait.tracking.settings import WandbSettings


class WandbRun:
    """An open W&B run (:class:`~plait.tracking.background.TrackerClient`)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_wandb_run(settings: WandbSettings, *, run_name: str, run_dir: Path, config: dict[str, Any],
                   resume: bool, stream: TextIO | None = None) -> WandbRun:
    """Start (or, with ``resume``, continue) the W&B run of the plait run in ``run_dir``."""
    directory = Path(settings.dir).expanduser() if settings.dir is not None else run_dir
    directory.mkdir(parents=True, exist_ok=True)
    previous = read_run_id(run_dir, "wandb") if resume else None
    run = wandb.init(project=settings.project, entity=settings.entity, name=settings.name or run_name,
                     tags=list(settings.tags), mode=settings.mode, dir=str(directory), config=config,
                     id=previous, resume="allow" if previous else None,
                     settings=wandb.Settings(console="off", silent=True))
    record_run_id(run_dir, "wandb", run.id)
    offline = run.settings.mode in ("offline", "dryrun")
    where = str(Path(run.dir).parent) if offline else (run.url or run.project_url or "")
    hint = " (upload it with `wandb sync`)" if offline else ""
    print(f"plait: W&B run {run.id} {'continued' if previous else 'started'}: {where}{hint}",
          file=stream if stream is not None else sys.stderr, flush=True)
    return WandbRun(run)


__all__ = ["WandbRun", "open_wandb_run"]
