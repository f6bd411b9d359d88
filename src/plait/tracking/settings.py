"""The recipe's ``logging.wandb`` and ``logging.mlflow`` settings (null = that tracker is off).

Kept beside the trackers rather than in :mod:`plait.config.schema`, which only lists them. The
base repeats the schema's ``Section`` settings (unknown keys refused, assignments re-validated)
because the schema imports this module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: what ``logging.wandb.mode`` may be (W&B's own modes)
WANDB_MODES = ("online", "offline", "disabled")


class TrackerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


class WandbSettings(TrackerSettings):
    project: str = Field(default="plait", min_length=1, description="W&B project the run is logged to")
    entity: str | None = Field(default=None, min_length=1, description="W&B team or user; null = the "
                                                                       "account's default entity")
    name: str | None = Field(default=None, min_length=1, description="Run name shown in W&B; null = run.name")
    tags: list[str] = Field(default_factory=list, description="Tags of the W&B run")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        default=None, description="online = stream to the W&B server (needs an API key and the network); "
                                  "offline = write the run locally, upload later with `wandb sync`; null = "
                                  "$WANDB_MODE, else online")
    dir: str | None = Field(default=None, min_length=1, description="Directory W&B writes its wandb/ folder "
                                                                    "into; null = the run's output directory")


class MlflowSettings(TrackerSettings):
    tracking_uri: str | None = Field(
        default=None, min_length=1, description="MLflow tracking server or store (http(s)://..., file:///path, "
                                                "databricks); null = $MLFLOW_TRACKING_URI, else "
                                                "file://<run output dir>/mlruns")
    experiment: str = Field(default="plait", min_length=1, description="MLflow experiment (created when missing)")
    run_name: str | None = Field(default=None, min_length=1, description="MLflow run name; null = run.name")
