"""File modes of what plait writes: the process umask, as for any file the user creates.

``safetensors`` writes its files with mode 0600 and ``tempfile.mkdtemp`` makes 0700 directories,
so a model or checkpoint written on a shared machine or cluster file system could not be read by
the user's colleagues, or by the same user's jobs running under a service account. Everything
plait writes goes through :func:`apply_umask` before it becomes visible.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it where the kernel reports it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: read by setting (and restoring at once)
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """Give ``path`` (a file, or a directory and every file directly in it) the modes the umask allows."""
    mask = current_umask()
    path = Path(path)
    targets = [path, *path.iterdir()] if path.is_dir() else [path]
    for p in targets:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
