"""lm-eval tasks found, run on a plait model, and their metrics read back as rows.

Task names are checked before a model loads: a name lm-eval does not know is an
:class:`LmEvalError` listing the close matches. lm-eval indexes its ~14,000 built-in task files
in several seconds, so when every requested name is a task of the include directory (or a YAML
file path) only that directory is indexed; the result is the same, since lm-eval lets an
include directory's tasks override built-in ones of the same name.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate  # type: ignore[import-untyped]
from lm_eval.api.model import LM  # type: ignore[import-untyped]
from lm_eval.tasks import TaskManager  # type: ignore[import-untyped]

from plait.evaluation.errors import LmEvalError

#: lm-eval's own default number of bootstrap resamples for the standard errors that need them
BOOTSTRAP_ITERS = 100_000


@dataclass(frozen=True)
class TaskMetric:
    """One metric of one task (or group): ``filter`` is lm-eval's filter name (``none`` when the
    task has no filters); ``stderr`` is None where lm-eval gives none."""

    task: str
    metric: str
    filter: str
    value: float
    stderr: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task, "metric": self.metric, "filter": self.filter, "value": self.value,
                "stderr": self.stderr}


def parse_task_names(text: str) -> list[str]:
    """``TASK[,TASK...]`` as a list; empty names are an error."""
    names = [n.strip() for n in text.split(",")]
    if not names or any(not n for n in names):
        raise LmEvalError(f"--lm-eval {text!r}: give task names separated by commas, e.g. --lm-eval arc_easy,piqa")
    return names


def task_manager(names: Sequence[str], include: str | os.PathLike | None = None, *,
                 include_defaults: bool = True) -> Any:
    """An lm-eval ``TaskManager`` that knows every name of ``names`` (a task, group or tag name,
    or the path of a task YAML), indexing lm-eval's built-in tasks only when the include
    directory lacks one (``include_defaults=False``: never)."""
    include_dir = None
    if include is not None:
        include_dir = Path(include).expanduser()
        if not include_dir.is_dir():
            raise LmEvalError(f"--lm-eval-include {include}: no such directory; give the directory of your task YAML "
                              f"files")
    missing = [n for n in names if not Path(n).is_file()]
    if include_dir is not None:
        local = TaskManager(include_path=str(include_dir), include_defaults=False)
        if all(n in local.all_tasks for n in missing) or not include_defaults:
            return _checked(local, missing, include_dir)
    if not include_defaults:
        return _checked(TaskManager(include_defaults=False), missing, include_dir)
    return _checked(TaskManager(include_path=None if include_dir is None else str(include_dir)), missing,
                    include_dir)


def _checked(manager: Any, names: Sequence[str], include_dir: Path | None) -> Any:
    known = list(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hints.append(f"{name!r}" + (f" (close: {', '.join(close)})" if close else ""))
        where = f"lm-eval's tasks or {include_dir}" if include_dir is not None else \
            "lm-eval's tasks (local task YAMLs: --lm-eval-include DIR)"
        raise LmEvalError(f"unknown task {'; '.join(hints)}: not among {where}")
    return manager


def run_tasks(lm: Any, names: Sequence[str], manager: Any, *, limit: int | float | None = None,
              num_fewshot: int | None = None, bootstrap_iters: int = BOOTSTRAP_ITERS,
              seed: int = 0, log_samples: bool = False) -> tuple[list[TaskMetric], dict[str, Any]] | None:
    """``(metric rows, lm-eval's whole results dict)`` of ``names`` on ``lm`` (an lm-eval ``LM``,
    e.g. :class:`~plait.evaluation.lm_eval_model.PlaitLM`); ``limit``: documents per task (a
    fraction below 1: that share of them); ``log_samples``: keep each request's responses in
    ``results["samples"]``. Under tensor parallelism every rank of the group calls it with the
    same arguments and computes the same scores; lm-eval reports them to one process only: under
    a launcher (``LOCAL_RANK`` set) the others get None."""
    if not isinstance(lm, LM):
        raise TypeError(f"lm must be an lm-eval LM, got {type(lm).__name__}")
    results = simple_evaluate(model=lm, tasks=list(names), task_manager=manager, limit=limit,
                              num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters, log_samples=log_samples,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed)
    return None if results is None else (metric_rows(results), results)


def metric_rows(results: dict[str, Any]) -> list[TaskMetric]:
    """The numeric metrics of lm-eval's ``results["results"]``, one row each (keys of the form
    ``metric,filter``; ``metric_stderr,filter`` becomes the row's ``stderr``)."""
    rows = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key.split(",")[0] or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            rows.append(TaskMetric(task, metric, filter_name, float(value),
                                   float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr)
                                   else None))
    return rows


def metrics_table(rows: Sequence[TaskMetric]) -> str:
    """The rows as an aligned text table (task, metric, value, stderr)."""
    header = ("task", "metric", "value", "stderr")
    body = [(r.task, r.metric if r.filter == "none" else f"{r.metric} ({r.filter})", f"{r.value:.4f}",
             "" if r.stderr is None else f"{r.stderr:.4f}") for r in rows]
    widths = [max(len(line[c]) for line in [header, *body]) for c in range(4)]
    lines = ["  ".join(cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(line, widths,
                                                                                                    strict=True)))
             for line in [header, *body]]
    return "\n".join(line.rstrip() for line in lines)


__all__ = ["BOOTSTRAP_ITERS", "TaskMetric", "metric_rows", "metrics_table", "parse_task_names", "run_tasks",
           "task_manager"]
