"""Writing a directory whole: built under a temporary name beside its target, then swapped in.

Every model directory plait writes (a Hugging Face model, a LoRA adapter) goes through
:func:`written_whole`, so a reader never sees half a directory, the new one carries plait's marker,
and only an absent or empty directory, or (with ``replace``) one plait wrote, is ever replaced: the
target is checked before any work and again just before the swap.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from plait.outputs.ownership import Kind, require_target, write_marker
from plait.outputs.permissions import apply_umask


@contextmanager
def written_whole(path: str | os.PathLike, kind: Kind, *, what: str, replace: bool = False,
                  replace_hint: str = "") -> Iterator[Path]:
    """Yield a temporary directory to fill; on success it becomes ``path`` (see the module doc),
    on any failure it is removed and ``path`` is left as it was."""
    target = Path(path)
    require_target(target, kind, what=what, replace=replace, replace_hint=replace_hint)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        write_marker(tmp, kind)
        apply_umask(tmp)  # mkdtemp and safetensors make owner-only files
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            require_target(target, kind, what=what, replace=replace, replace_hint=replace_hint)
            os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
