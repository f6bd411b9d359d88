"""Finding, committing and retiring checkpoint directories.

The newest complete checkpoint is the one whose *manifest* says complete with the highest step,
never the newest by modification time (clocks and copies lie). A checkpoint becomes visible only
through an atomic rename of its ``.tmp`` directory after its manifest was written and synced, so
a crash at any moment leaves either the previous set of checkpoints or the new one, never a
half-written directory under a final name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from plait.checkpoint.format import CheckpointError, fsync_dir, read_manifest, step_dir_name


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        if not d.is_dir() or not d.name.startswith("step-") or d.name.endswith((".tmp", ".old")):
            continue
        try:
            out.append((int(read_manifest(d)["step"]), d))
        except (CheckpointError, ValueError, TypeError):
            continue
    return sorted(out)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def incomplete_dirs(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and d.name.startswith("step-")
                  and (d.name.endswith((".tmp", ".old")) or not (d / "manifest.json").is_file()))


def _step_of(d: Path) -> int | None:
    try:
        return int(d.name.split("-", 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        return None


def remove_incomplete(root: str | Path, below_step: int | None = None) -> list[Path]:
    """Delete interrupted checkpoint directories; returns them.

    ``below_step``: only those of earlier steps. After committing step N, the directories of
    later steps may be ones other ranks are already writing (they run ahead of rank 0's commit),
    so they must not be touched.
    """
    removed = []
    for d in incomplete_dirs(root):
        step = _step_of(d)
        if below_step is not None and (step is None or step >= below_step):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def commit(tmp: Path, step: int) -> Path:
    """Rename the finished ``tmp`` directory to its final name (replacing an older one of that step)."""
    final = tmp.parent / step_dir_name(step)
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(tmp.parent)
    return final


def apply_retention(root: str | Path, keep: int, keep_every: int = 0) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep`` ones, except every ``keep_every``-th step.

    The newest complete checkpoint is never deleted, whatever ``keep`` says. Returns the deleted ones.
    """
    found = complete_checkpoints(root)
    if not found:
        return []
    newest = found[-1][1]
    protected = {d for _, d in found[-max(keep, 1):]} | {newest}
    if keep_every > 0:
        protected |= {d for s, d in found if s % keep_every == 0}
    removed = []
    for _, d in found:
        if d not in protected:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed
