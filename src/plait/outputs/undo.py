"""Leaving nothing behind when a run is refused after its directories were claimed.

``plait train`` creates and probes its output directories before it prepares the data (so an
unwritable disk fails in a second, not after minutes of tokenising); a run then refused for its
data must not leave those directories behind. :func:`missing_roots` notes, before the claim, the
topmost directory of each target that does not exist yet; :func:`remove_untouched` removes each
of them again if it holds nothing but plait's own bookkeeping files (the marker and the lock), so
a directory that existed, or that anything else wrote into meanwhile, is never touched. A
directory that existed keeps nothing of the refused run either: :func:`unmarked` notes which of
the targets had no marker before the claim, and :func:`remove_new_bookkeeping` takes the marker and
the lock file out of those again (so a user's folder does not become "written by plait").
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from plait.outputs.lock import LOCK_FILE
from plait.outputs.ownership import MARKER


def missing_roots(paths: Iterable[str | Path]) -> list[Path]:
    """The topmost not-yet-existing directory on the way to each of ``paths`` (deduplicated)."""
    roots: list[Path] = []
    for path in paths:
        p = Path(path).expanduser().absolute()
        if p.exists() or p.is_symlink():
            continue
        while not p.parent.exists() and p.parent != p:
            p = p.parent
        if p not in roots:
            roots.append(p)
    return roots


def _only_bookkeeping(root: Path) -> bool:
    # every subdirectory is walked: one file of anyone's keeps the whole tree
    return all(name.startswith(".plait-") for _, _, files in os.walk(root) for name in files)


def remove_untouched(roots: Iterable[Path]) -> list[Path]:
    """Remove each of ``roots`` that holds only plait's bookkeeping files; returns those removed."""
    removed = []
    for root in roots:
        if root.is_dir() and not root.is_symlink() and _only_bookkeeping(root):
            shutil.rmtree(root, ignore_errors=True)
            removed.append(root)
    return removed


def unmarked(paths: Iterable[str | Path]) -> list[Path]:
    """The existing directories among ``paths`` that hold no ownership marker yet."""
    return [Path(p) for p in paths if Path(p).is_dir() and not (Path(p) / MARKER).exists()]


def remove_new_bookkeeping(directories: Iterable[Path]) -> None:
    """Remove the marker and the lock file a refused claim left in ``directories`` (from :func:`unmarked`)."""
    for directory in directories:
        for name in (MARKER, LOCK_FILE):
            try:
                (directory / name).unlink()
            except FileNotFoundError:
                pass
