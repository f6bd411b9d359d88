"""The interface of every metrics destination: files, TensorBoard, the progress bar and the trackers.

Kept in :mod:`plait.tracking`, the lowest layer that knows about metrics, so the trackers and
the run's own sinks (:mod:`plait.train.loggers`, which re-exports it) share one base.
"""

from __future__ import annotations


class MetricsSink:
    """Interface of a metrics destination."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make everything logged so far visible to readers."""

    def close(self) -> None:
        """Flush and release the destination; ``log`` must not be called afterwards."""

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MetricsSink"]
