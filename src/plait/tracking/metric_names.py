"""The grouped names under which trackers and TensorBoard show the trainer's metrics.

``metrics.jsonl`` keeps the flat keys the trainer computes (``loss``, ``val_loss``,
``tokens_per_s``; docs/metrics.md), which scripts and the run summary read. Dashboards group
charts by the first path component, so TensorBoard, W&B and MLflow all receive the same
three groups instead:

* ``val/...``: every evaluation score (a key starting with ``val_``: ``val_loss`` -> ``val/loss``,
  ``val_loss/<source>`` -> ``val/loss/<source>``, ``val_rewards/accuracy`` -> ``val/rewards/accuracy``);
* ``perf/...``: throughput, utilisation, memory and time (:data:`PERF_KEYS`);
* ``train/...``: everything else the optimisation reports (loss, lr, grad_norm, objective and MoE
  statistics).

One function makes the mapping so the three sinks can never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the flat keys that measure speed, memory and time rather than the optimisation
PERF_KEYS = frozenset({"tokens_per_s", "tokens_per_s_per_device", "mfu", "peak_memory_gb", "peak_memory_bytes",
                       "data_wait_share", "data_wait_s", "step_time_s", "elapsed_s", "compile_s"})


def grouped_name(key: str) -> str:
    """The ``train/``, ``val/`` or ``perf/`` name of the flat metric key ``key``."""
    if key.startswith("val_"):
        return "val/" + key[len("val_"):]
    if key in PERF_KEYS:
        return "perf/" + key
    return "train/" + key


def grouped_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a logged record under their grouped names (``step`` and non-numbers dropped)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "step":
            continue
        if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[grouped_name(key)] = float(value)
    return out


__all__ = ["PERF_KEYS", "grouped_name", "grouped_scalars"]
