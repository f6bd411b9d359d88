"""A tracker behind a worker thread: training never waits for it and never stops because of it.

A W&B or MLflow client talks to a server that may be slow, unreachable or gone mid-run (MLflow's
HTTP client retries with back-off for minutes). So the trainer's ``log`` call only puts the
record on a bounded queue; one thread opens the client, sends the records in order and closes
it. The first failure of the client (opening, logging or closing) is printed once, as one line
naming the tracker and the error, and the tracker is switched off for the rest of the run:
the metrics still reach ``metrics.jsonl`` and TensorBoard. Records the thread cannot keep up
with (the queue is full) are dropped with one line too, never blocking the step.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Protocol, TextIO, cast

from plait.tracking.metric_names import grouped_scalars
from plait.tracking.sink import MetricsSink


class TrackerClient(Protocol):
    """What a tracker provides once opened: scalars under their grouped names, then a close."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


_CLOSE = object()


class BackgroundTracker(MetricsSink):
    """A :class:`MetricsSink` that hands records to ``open_client()``'s client on its own thread.

    ``label`` names the tracker in the warning (``"W&B"``, ``"MLflow"``). ``close`` waits up to
    ``close_timeout_s`` for the records in flight, then gives up with one line, so a dead server
    cannot hold the end of the run.
    """

    def __init__(self, label: str, open_client: Callable[[], TrackerClient], *, queue_size: int = 10000,
                 close_timeout_s: float = 120.0, stream: TextIO | None = None) -> None:
        self.label = label
        self.close_timeout_s = close_timeout_s
        self._stream = stream
        self._open_client = open_client
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._failed = threading.Event()
        self._warned_full = False
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"plait-{label}", daemon=True)
        self._thread.start()

    @property
    def failed(self) -> bool:
        """True once the tracker has failed and was switched off."""
        return self._failed.is_set()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._closed or self.failed:
            return
        try:
            self._queue.put_nowait((int(step), grouped_scalars(metrics)))
        except queue.Full:
            if not self._warned_full:
                self._warned_full = True
                self._say(f"{self.label} falls behind the training (a slow server?); the records it cannot "
                          f"take are dropped")

    def flush(self) -> None:
        """Wait (up to ``close_timeout_s``) until every record logged so far was handed to the client."""
        if self._closed or self.failed:
            return
        done = threading.Event()
        try:
            self._queue.put(done, timeout=self.close_timeout_s)
        except queue.Full:
            return
        done.wait(self.close_timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_CLOSE, timeout=self.close_timeout_s)
        except queue.Full:
            pass
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            self._say(f"{self.label} did not finish sending within {self.close_timeout_s:g} s; its last records "
                      f"may be missing")

    # ------------------------------------------------------------------ the worker thread
    def _work(self) -> None:
        try:
            client = self._open_client()
        except Exception as e:  # noqa: BLE001 - any failure of a tracker leaves training running
            self._fail("could not start", e)
            self._drain()
            return
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                break
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self.failed:
                continue
            step, scalars = cast(tuple[int, dict[str, float]], item)
            try:
                client.log(step, scalars)
            except Exception as e:  # noqa: BLE001
                self._fail(f"failed at step {step}", e)
        try:
            client.close()
        except Exception as e:  # noqa: BLE001
            self._fail("failed to finish the run", e)

    def _drain(self) -> None:
        """After a failed start: answer flushes and stop at the close, dropping the records."""
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            if isinstance(item, threading.Event):
                item.set()

    def _fail(self, what: str, error: BaseException) -> None:
        if not self.failed:
            self._failed.set()
            reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
            self._say(f"{self.label} logging {what} ({reason}); training goes on without it")

    def _say(self, text: str) -> None:
        print(f"plait: warning: {text}", file=self._stream if self._stream is not None else sys.stderr, flush=True)


__all__ = ["BackgroundTracker", "TrackerClient"]
