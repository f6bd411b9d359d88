"""Experiment trackers: Weights & Biases and MLflow beside ``metrics.jsonl`` and TensorBoard.

Every destination shows the trainer's metrics under the same grouped names (``train/``,
``val/``, ``perf/``; :mod:`plait.tracking.metric_names`) with the resolved recipe as the run's
config. Problems a tracker would meet at its start are refused before launch
(:mod:`plait.config.rules.trackers`); a tracker that fails mid-run warns once and training goes
on (:mod:`plait.tracking.background`). See docs/metrics.md#trackers.
"""
