"""MLflow as a metrics destination (``logging.mlflow``).

Talks to the tracking store through an explicit :class:`mlflow.MlflowClient` (no fluent, global
active run). The resolved recipe becomes the run's parameters (``section.field``, as MLflow
params are flat) and its ``recipe.yaml`` artifact; the trainer's records are logged under the
grouped names (:mod:`plait.tracking.metric_names`) at the optimizer step. A resumed plait run
continues the same MLflow run (its id is kept in the run directory) and does not log the
parameters again (MLflow refuses to change one; the resumed layout's recipe is logged as
``recipe-step-<S>.yaml``).

MLflow 3 refuses its file store (``file://...``) unless ``MLFLOW_ALLOW_FILE_STORE`` is set; a
recipe that names a file store (or leaves the default one in the run directory) asked for it,
so plait sets that variable for its own process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException

from plait.tracking.run_ids import read_run_id, record_run_id
from plait.tracking.settings import MlflowSettings
from plait.tracking.uris import is_file_store, tracking_uri_for

#: MLflow's limits: parameters per batch call and characters of a parameter value
PARAMS_PER_BATCH = 100
PARAM_VALUE_CHARS = 6000


class MlflowRun:
    """An open MLflow run (:class:`~plait.tracking.background.TrackerClient`)."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, RunStatus.to_string(RunStatus.FINISHED))


def flat_params(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``{"parallel": {"tp": 2}}`` -> ``("parallel.tp", "2")``; lists and mappings below a field as JSON."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix:
            yield from flat_params(value, name + ".")
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            yield name, text[:PARAM_VALUE_CHARS]


def _experiment_id(client: MlflowClient, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name)
        except MlflowException:  # another run created it meanwhile
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage != "active":
        raise ValueError(f"MLflow experiment {name!r} is deleted; restore it or set logging.mlflow.experiment")
    return found.experiment_id


def open_mlflow_run(settings: MlflowSettings, *, run_name: str, run_dir: Path, config: dict[str, Any],
                    recipe_yaml: str, start_step: int, stream: TextIO | None = None) -> MlflowRun:
    """Start (or, when resuming at ``start_step > 0``, continue) the MLflow run of the plait run in ``run_dir``."""
    uri = tracking_uri_for(settings, run_dir)
    if is_file_store(uri):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    previous = read_run_id(run_dir, "mlflow") if start_step > 0 else None
    run_id = None
    if previous is not None:
        try:
            run_id = client.get_run(previous).info.run_id
        except MlflowException:  # the run is gone from this store: start a new one
            run_id = None
    if run_id is None:
        run = client.create_run(_experiment_id(client, settings.experiment), run_name=settings.run_name or run_name,
                                tags={"plait.run_dir": str(run_dir.resolve())})
        run_id = run.info.run_id
        params = [Param(k, v) for k, v in flat_params(config)]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[i:i + PARAMS_PER_BATCH])
        client.log_text(run_id, recipe_yaml, "recipe.yaml")
    else:
        client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        client.set_tag(run_id, "plait.resumed_at_step", str(start_step))
        client.log_text(run_id, recipe_yaml, f"recipe-step-{start_step}.yaml")
    record_run_id(run_dir, "mlflow", run_id, tracking_uri=uri)
    print(f"plait: MLflow run {run_id} {'continued' if previous == run_id else 'started'} in experiment "
          f"{settings.experiment!r} at {uri}", file=stream if stream is not None else sys.stderr, flush=True)
    return MlflowRun(client, run_id)


__all__ = ["MlflowRun", "flat_params", "open_mlflow_run"]
