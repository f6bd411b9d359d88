"""The id of each tracker's run, kept in the run directory so that a resumed run logs to the same one.

Each tracker has its own small hidden file (``.plait-tracker-<name>.json``), written atomically
by the thread that opened the run; hidden ``.plait-`` files are plait's bookkeeping and do not
make a run directory look foreign (:mod:`plait.outputs.ownership`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _path(run_dir: str | os.PathLike, tracker: str) -> Path:
    return Path(run_dir) / f".plait-tracker-{tracker}.json"


def read_run_id(run_dir: str | os.PathLike, tracker: str) -> str | None:
    """The recorded run id of ``tracker`` (``"wandb"``, ``"mlflow"``), or ``None`` when there is none."""
    try:
        data = json.loads(_path(run_dir, tracker).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    run_id = data.get("run_id") if isinstance(data, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def record_run_id(run_dir: str | os.PathLike, tracker: str, run_id: str, **details: str) -> None:
    """Record ``run_id`` (and e.g. the tracking URI it lives at) for the next resume of this run."""
    path = _path(run_dir, tracker)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"run_id": run_id, **details}) + "\n", encoding="utf-8")
    os.replace(tmp, path)


__all__ = ["read_run_id", "record_run_id"]
