"""One run per directory: an advisory lock that dies with the process holding it.

The lock is ``flock`` on a file ``.plait-lock`` in the directory. The kernel releases it when its
holder exits, however it exits (``kill -9`` included), so a killed run never leaves a lock
behind that blocks its restart; there is no stale-lock timeout to guess. The file records the
holder's host and PID so a refused second run can say who holds the directory.

Who holds it: ``plait train`` started plainly holds it in the launching process for the whole
run (the workers are its children); under ``torchrun`` or SLURM, global rank 0 holds it. The
environment variable :data:`HELD_ENV` tells the workers that their launcher already does.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from plait.outputs.ownership import OutputDirError

LOCK_FILE = ".plait-lock"
#: set by a launcher that holds the locks of its workers' directories
HELD_ENV = "PLAIT_RUN_LOCK_HELD"


class DirectoryLockedError(OutputDirError):
    """Another live process holds the directory."""


class DirectoryLock:
    """An exclusive, non-blocking lock on ``directory`` (created if missing)."""

    def __init__(self, directory: str | Path, *, what: str) -> None:
        self.directory = Path(directory)
        self.what = what
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> DirectoryLock:
        """Take the lock or raise :class:`DirectoryLockedError` naming the holder."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DirectoryLockedError(
                f"{self.what}={self.directory} is in use by another plait run ({holder}); wait for it to end, "
                f"or give this run another directory") from None
        except OSError:
            os.close(fd)
            raise
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {info['host']}, PID {info['pid']}, since {info.get('since', '?')}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def acquire_all(directories: list[tuple[str, Path]]) -> list[DirectoryLock]:
    """Lock every distinct directory of ``(setting name, path)``; all or none."""
    locks: list[DirectoryLock] = []
    seen: set[Path] = set()
    try:
        for what, path in directories:
            key = Path(path).expanduser().resolve()
            if key in seen:
                continue
            seen.add(key)
            locks.append(DirectoryLock(path, what=what).acquire())
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks
