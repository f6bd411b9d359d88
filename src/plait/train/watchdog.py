"""Turns a stalled collective into an error that names the rank, the group and the operation.

A collective that never completes (a peer died without its socket closing, a rank is stuck in
its data loader, a deadlocked schedule) blocks inside C++ where Python cannot interrupt it, and
the job hangs silently until the backend's own timeout, 30 minutes by default. The trainer wraps
each communicating phase of a step in :meth:`Watchdog.watch` with the operation's name and its
process group. A daemon thread checks the open phase, and once it has lasted longer than
``timeout`` seconds it reports::

    plait watchdog: rank 3 stalled for 61.0 s in data-parallel gradient reduction
    (group dp, ranks [1, 3]) at step 120; aborting

and then ends the process (exit status 3) so that the launcher's failure handling
(``torchrun --max-restarts``) takes over. No host synchronisation is added: entering and
leaving a phase is two ``time.monotonic()`` calls.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

EXIT_STATUS = 3


def _abort(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_STATUS)


class Watchdog:
    def __init__(self, timeout: float, rank: int, *, on_stall: Callable[[str], None] = _abort,
                 poll: float | None = None) -> None:
        self.timeout, self.rank, self.on_stall = timeout, rank, on_stall
        self.step = 0
        self._phase: tuple[str, str, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if timeout > 0:
            self._poll = poll if poll is not None else min(1.0, timeout / 4)
            self._thread = threading.Thread(target=self._run, name="plait-watchdog", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def watch(self, operation: str, group: str = "") -> Iterator[None]:
        """Time the enclosed phase; ``group`` describes the process group (axis and ranks)."""
        if self._thread is None:
            yield
            return
        with self._lock:
            self._phase = (operation, group, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._phase = None

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            with self._lock:
                phase = self._phase
            if phase is None:
                continue
            operation, group, start = phase
            waited = time.monotonic() - start
            if waited > self.timeout:
                where = f" ({group})" if group else ""
                self.on_stall(f"plait watchdog: rank {self.rank} stalled for {waited:.1f} s in {operation}{where} "
                              f"at step {self.step + 1}; aborting (train.stall_timeout_s={self.timeout:g})")
                with self._lock:
                    if self._phase is phase:
                        self._phase = None  # report once per phase when on_stall returns

    def close(self) -> None:
        self._stop.set()
