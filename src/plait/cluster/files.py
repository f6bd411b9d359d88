"""Writing a launch file without ever replacing a file plait did not write.

A launch file carries :data:`~plait.cluster.spec.MARKER` in its first two lines. An existing
path is replaced only when it is a regular file that still carries it (an earlier ``plait
launch`` output the user has not taken over by editing the line away); anything else is refused
with the fix. The new text is written to a temporary sibling and renamed over the target, so
a reader never sees half a file.
"""

from __future__ import annotations

import os
from pathlib import Path

from plait.cluster.spec import MARKER
from plait.outputs import OutputDirError


def written_by_plait(path: Path) -> bool:
    """True when ``path`` is a regular file whose first two lines carry the launch-file marker."""
    if not path.is_file() or path.is_symlink():
        return False
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            head = [f.readline(), f.readline()]
    except OSError:
        return False
    return any(MARKER in line for line in head)


def write_launch_file(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` (refusing a file plait did not write); returns the path."""
    target = Path(path)
    if target.exists() or target.is_symlink():
        if not written_by_plait(target):
            what = "a directory" if target.is_dir() else "a file plait launch did not write"
            raise OutputDirError(f"{target} exists and is {what}; plait will not replace it. Choose another -o, "
                                 f"or move it away yourself")
    if not target.parent.is_dir():
        raise OutputDirError(f"the directory of {target} does not exist; create it first")
    tmp = target.with_name(f".{target.name}.plait-{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target
