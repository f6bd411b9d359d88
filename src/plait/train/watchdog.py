"""Turns a stalled collective into an error that names the rank, the group and the operation,
and leaves behind what is needed to find the rank that caused it.

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
leaving a phase is two ``time.monotonic()`` calls and a dictionary store (the last collective
entered per group).

Hang diagnosis. The ranks waiting in a collective are rarely the culprit; the rank that never
arrived is. Before exiting, a stalled rank

* writes ``hang/rank-N.txt`` under ``dump_dir`` (the run directory): the Python stack of every
  thread of the process, its phase, step and the last collective phase it entered per group,
  and, from :mod:`plait.comm.trace`, how many collectives it entered on each process group and
  the last one (a rank with a lower count fell behind);
* publishes a one-line report in the job's key-value store (the c10d store every rank already
  shares) and raises a flag there.

A rank that is not in a collective but has made no progress for ``timeout`` seconds (the one
that sleeps, loops or waits on I/O) looks at the flag from its watchdog thread, and when it is
raised dumps and reports in the same way (it does not exit by itself: the stalled ranks do, and
the launcher then stops the job). Rank 0 collects the reports for a short grace period
and prints which ranks of the stalled group never arrived at the collective, and where they were.
The store is only read when a rank has already made no progress for ``timeout`` seconds, so a
healthy run never touches it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait.comm.trace import last_entered

EXIT_STATUS = 3
#: keys in the job's store (prefixed by the restart attempt under an elastic launcher)
FLAG_KEY = "plait/hang/flag"
DONE_KEY = "plait/hang/summarized"
REPORT_KEY = "plait/hang/report/{rank}"
#: the sub-directory of ``dump_dir`` holding one ``rank-N.txt`` per rank
DUMP_SUBDIR = "hang"
_RANKS = re.compile(r"ranks \[([0-9, ]*)\]")


def _abort(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_STATUS)


def _default_store() -> dist.Store | None:
    """The default process group's key-value store, or ``None`` (no process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def thread_stacks() -> str:
    """The Python stack of every thread of this process, most recent call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"Thread {names.get(ident, '?')} (id {ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def group_ranks(group: str) -> list[int] | None:
    """The ranks a phase's group text names (``None``: every rank, e.g. "all ranks")."""
    found = _RANKS.findall(group)
    if not found:
        return None
    return sorted({int(r) for part in found for r in part.replace(" ", "").split(",") if r})


class Watchdog:
    def __init__(self, timeout: float, rank: int, *, on_stall: Callable[[str], None] = _abort,
                 poll: float | None = None, dump_dir: str | Path | None = None, store: dist.Store | None = None,
                 world: int | None = None, grace: float | None = None) -> None:
        self.timeout, self.rank, self.on_stall = timeout, rank, on_stall
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        self._store, self._world = store, world
        self._step = 0
        self._progress = time.monotonic()
        self._phase: tuple[str, str, float] | None = None
        #: group text -> (operation, step) of the last collective phase entered on that group
        self.last_entered: dict[str, tuple[str, int]] = {}
        self._diagnosed = False  # the dump and the report are made once per process
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if timeout > 0:
            self._poll = poll if poll is not None else min(1.0, timeout / 4)
            self.grace = grace if grace is not None else min(60.0, timeout + 2 * self._poll)
            self._thread = threading.Thread(target=self._run, name="plait-watchdog", daemon=True)
            self._thread.start()

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        """The trainer counts steps here; a step boundary is progress."""
        self._step = value
        self._progress = time.monotonic()

    @contextlib.contextmanager
    def watch(self, operation: str, group: str = "") -> Iterator[None]:
        """Time the enclosed phase; ``group`` describes the process group (axis and ranks)."""
        if self._thread is None:
            yield
            return
        with self._lock:
            self._phase = (operation, group, time.monotonic())
            for part in (group or "no peers").split("; "):
                self.last_entered[part] = (operation, self._step + 1)
        try:
            yield
        finally:
            with self._lock:
                self._phase = None
                self._progress = time.monotonic()

    # ------------------------------------------------------------------ the watching thread
    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            with self._lock:
                phase, progress = self._phase, self._progress
            now = time.monotonic()
            if phase is not None and now - phase[2] > self.timeout:
                self._stalled(phase, now - phase[2])
                with self._lock:
                    if self._phase is phase:
                        self._phase = None  # report once per phase when on_stall returns
                        self._progress = time.monotonic()
            elif phase is None and not self._diagnosed and now - progress > self.timeout and self._peer_stalled():
                self._stopped_by_peer(now - progress)
                with self._lock:
                    self._progress = time.monotonic()

    def _stalled(self, phase: tuple[str, str, float], waited: float) -> None:
        operation, group, _ = phase
        where = f" ({group})" if group else ""
        message = (f"plait watchdog: rank {self.rank} stalled for {waited:.1f} s in {operation}{where} "
                   f"at step {self.step + 1}; aborting (train.stall_timeout_s={self.timeout:g})")
        report = {"rank": self.rank, "step": self.step + 1, "operation": operation, "group": group,
                  "waited_s": round(waited, 1), "stalled": True}
        self._diagnose(report, message)
        self.on_stall(message)

    def _stopped_by_peer(self, idle: float) -> None:
        message = (f"plait watchdog: rank {self.rank} stops: a peer stalled while this rank was outside any "
                   f"collective at step {self.step + 1} (no progress for {idle:.1f} s)")
        report = {"rank": self.rank, "step": self.step + 1, "operation": None, "group": "", "waited_s": round(idle, 1),
                  "stalled": False}
        print(message, file=sys.stderr, flush=True)
        # no exit here: the stalled ranks exit, and the launcher then stops this one with the job
        self._diagnose(report, message)

    # ------------------------------------------------------------------ diagnosis
    def _store_or_none(self) -> dist.Store | None:
        if self._store is None:
            self._store = _default_store()
        return self._store

    def _peer_stalled(self) -> bool:
        store = self._store_or_none()
        if store is None:
            return False
        try:
            return bool(store.check([FLAG_KEY]))
        except Exception:  # noqa: BLE001 - a store gone with its host: nothing to learn from it
            return False

    def _diagnose(self, report: dict[str, Any], message: str) -> None:
        """Dump this rank's stacks, publish its report, and (rank 0) print who never arrived (once)."""
        if self._diagnosed:
            return
        self._diagnosed = True
        with self._lock:
            report["last_collectives"] = {g: {"operation": op, "step": s} for g, (op, s) in self.last_entered.items()}
        report["collectives"] = last_entered()  # per group: how many collectives entered, and the last one
        report["host"], report["pid"] = socket.gethostname(), os.getpid()
        dump = self._write_dump(report, message)
        if dump is not None:
            report["dump"] = str(dump)
        store = self._store_or_none()
        if store is None:
            return
        try:
            store.set(REPORT_KEY.format(rank=self.rank), json.dumps(report))
            if report["stalled"]:
                store.set(FLAG_KEY, str(self.rank))
            if self.rank == 0:
                print(self.summary(report, self._collect(store)), file=sys.stderr, flush=True)
                store.set(DONE_KEY, "1")
            else:  # stay until rank 0 has read every report (the launcher stops the job at the first exit)
                self._wait_for(store, [DONE_KEY], self.grace + self._poll)
        except Exception as e:  # noqa: BLE001 - the diagnosis must never hide the stall itself
            print(f"plait watchdog: rank {self.rank}: could not share the hang report: {e}", file=sys.stderr,
                  flush=True)

    def _write_dump(self, report: dict[str, Any], message: str) -> Path | None:
        if self.dump_dir is None:
            return None
        path = self.dump_dir / DUMP_SUBDIR / f"rank-{self.rank}.txt"
        lines = [message, "", f"host {report['host']}, pid {report['pid']}, step {report['step']}",
                 f"phase: {report['operation'] or 'none (outside any collective)'}"
                 + (f" ({report['group']})" if report["group"] else ""), "", "last collective entered per group:"]
        lines += [f"  {g}: {v['operation']} at step {v['step']}" for g, v in report["last_collectives"].items()]
        if not report["last_collectives"]:
            lines.append("  (none)")
        lines += ["", "collectives entered per process group (a rank with a lower count fell behind):"]
        lines += [f"  {g}: {v['count']} entered, the last one {v['operation']}"
                  for g, v in report["collectives"].items()]
        if not report["collectives"]:
            lines.append("  (none)")
        lines += ["", "Python stacks of this process's threads:", "", thread_stacks()]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(lines), encoding="utf-8")
        except OSError as e:
            print(f"plait watchdog: rank {self.rank}: cannot write {path}: {e}", file=sys.stderr, flush=True)
            return None
        return path

    def _world_size(self) -> int:
        if self._world is None:
            self._world = dist.get_world_size() if dist.is_initialized() else 1
        return self._world

    def _wait_for(self, store: dist.Store, keys: list[str], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if store.check(keys):
                return True
            time.sleep(min(self._poll, 0.1))
        return False

    def _collect(self, store: dist.Store) -> dict[int, dict[str, Any]]:
        """Every rank's report that arrives within the grace period."""
        world = self._world_size()
        keys = {r: REPORT_KEY.format(rank=r) for r in range(world)}
        self._wait_for(store, list(keys.values()), self.grace)
        reports = {}
        for r, key in keys.items():
            if store.check([key]):
                reports[r] = json.loads(store.get(key))
        return reports

    def summary(self, mine: dict[str, Any], reports: dict[int, dict[str, Any]]) -> str:
        """Which ranks of the stalled collective never arrived at it, and where they were."""
        stalled = mine if mine["stalled"] else next((r for _, r in sorted(reports.items()) if r["stalled"]), mine)
        expected = group_ranks(stalled["group"])
        if expected is None:
            expected = list(range(self._world_size()))
        arrived, missing = [], []
        for r in expected:
            rep = reports.get(r)
            if rep is not None and rep["operation"] == stalled["operation"] and rep["step"] == stalled["step"]:
                arrived.append(str(r))
            elif rep is None:
                missing.append(f"rank {r} (no report: its process is gone or frozen)")
            else:
                where = f"in {rep['operation']}" if rep["operation"] else "outside any collective"
                missing.append(f"rank {r} on {rep['host']} (at step {rep['step']}, {where})")
        lines = [f"plait watchdog: step {stalled['step']}, {stalled['operation']}: "
                 + (f"ranks that never arrived: {'; '.join(missing)}" if missing else "every rank arrived")
                 + f"; arrived: {', '.join(arrived) or 'none'}"]
        if self.dump_dir is not None:
            lines.append(f"plait watchdog: Python stacks and last collectives of each rank: "
                         f"{self.dump_dir / DUMP_SUBDIR}/rank-N.txt")
        return "\n".join(lines)

    def close(self) -> None:
        self._stop.set()
