"""The tracker sinks a recipe asks for (``logging.wandb``, ``logging.mlflow``), on the writing rank.

Each tracker runs behind a :class:`~plait.tracking.background.BackgroundTracker`, so opening it,
logging and closing happen on its own thread and a failure only warns. The tracker modules are
imported only when the recipe names that tracker: importing MLflow takes over a second, which
every run without it should not pay.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, TextIO

from plait.config.load import recipe_to_yaml
from plait.config.resolve import ResolvedRecipe
from plait.tracking.background import BackgroundTracker
from plait.train.loggers import MetricsSink


def run_config(resolved: ResolvedRecipe) -> dict[str, Any]:
    """The resolved recipe as a tracker's run config: every section and field, plus the world size."""
    return {**resolved.as_recipe().model_dump(mode="json"), "world_size": resolved.world_size}


def tracker_sinks(resolved: ResolvedRecipe, start_step: int, *, stream: TextIO | None = None) -> list[MetricsSink]:
    """A background sink per tracker of ``resolved``'s recipe; a run resuming at ``start_step > 0``
    continues the trackers' runs recorded in its output directory."""
    lg, run_dir = resolved.recipe.logging, Path(resolved.output_dir)
    name = resolved.recipe.run.name
    sinks: list[MetricsSink] = []
    if lg.wandb is not None:
        from plait.tracking.wandb_run import open_wandb_run  # imported here: only runs that use W&B load it

        sinks.append(BackgroundTracker("W&B", functools.partial(
            open_wandb_run, lg.wandb, run_name=name, run_dir=run_dir, config=run_config(resolved),
            resume=start_step > 0, stream=stream), stream=stream))
    if lg.mlflow is not None:
        from plait.tracking.mlflow_run import open_mlflow_run  # imported here: MLflow takes a second to import

        sinks.append(BackgroundTracker("MLflow", functools.partial(
            open_mlflow_run, lg.mlflow, run_name=name, run_dir=run_dir, config=run_config(resolved),
            recipe_yaml=recipe_to_yaml(resolved, header="resolved recipe of this run"), start_step=start_step,
            stream=stream), stream=stream))
    return sinks


__all__ = ["run_config", "tracker_sinks"]
