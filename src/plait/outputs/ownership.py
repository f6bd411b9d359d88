"""Which directories plait may write into, and which it may replace.

The rule: plait never deletes or replaces anything it did not create. Every directory plait
writes as a whole (a run's output directory, a directory of training checkpoints, a Hugging Face
model directory) carries a small marker file, ``.plait-output.json``, naming its kind. Before any
work starts, each target is classified:

* absent or empty: plait may create it;
* a plait output of the expected kind: plait may write into it again (a run directory, a
  checkpoint directory) or, for a model directory, replace it when allowed (``--overwrite`` /
  ``checkpoint.overwrite``, or the run's own final model on a re-run);
* anything else (the user's files, a plait output of another kind, a file): refused with a
  message naming the directory, what it holds and the fix.

Directories written before markers existed are recognised by their contents: a run directory
holding only the names a run writes, a checkpoint directory holding only ``step-N`` directories.

A target may also never be the source of the same command, nor contain it (``plait convert
RUN/checkpoints RUN`` would replace the run it reads from).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

MARKER = ".plait-output.json"
Kind = Literal["run", "checkpoints", "hf-model"]

#: what a run writes into its output directory (a directory holding only these is a run directory)
RUN_ENTRIES = frozenset({"recipe.yaml", "metrics.jsonl", "tensorboard", "loss.png", "summary.txt", "sample.txt",
                         "tokenizer.json", "final", "checkpoints", "wandb", "mlruns"})
_KIND_TEXT = {"run": "a plait run directory", "checkpoints": "a plait checkpoint directory",
              "hf-model": "a Hugging Face model directory written by plait"}


class OutputDirError(ValueError):
    """A directory plait was asked to write is not plait's to write (or cannot be written)."""


def _entries(path: Path) -> list[str]:
    """Names in ``path`` apart from plait's own hidden bookkeeping files."""
    return sorted(n for n in os.listdir(path) if not n.startswith(".plait-"))


def _empty_dir(path: Path) -> bool:
    """A directory (not a link) holding nothing but plait's hidden bookkeeping files."""
    return path.is_dir() and not path.is_symlink() and not _entries(path)


def read_kind(path: str | Path) -> Kind | None:
    """The kind recorded in ``path``'s marker, or ``None`` when there is no readable marker."""
    try:
        data = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kind = data.get("kind") if isinstance(data, dict) else None
    return kind if kind in _KIND_TEXT else None


def write_marker(path: str | Path, kind: Kind) -> None:
    """Record that plait created ``path`` as a ``kind`` directory (kept if already there)."""
    marker = Path(path) / MARKER
    if read_kind(path) == kind:
        return
    info = {"kind": kind, "written_by": "plait", "host": socket.gethostname(), "pid": os.getpid(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = marker.with_name(f"{MARKER}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info) + "\n", encoding="utf-8")
    os.replace(tmp, marker)


#: the first line of the resolved recipe a run writes at its start (``plait.train.entry``)
RUN_RECIPE_HEADER = "# resolved recipe of this run"


def _looks_like(path: Path, kind: Kind) -> bool:
    """Recognise a directory plait wrote before it left markers, by what it holds: for a run,
    nothing but a run's entries, and among them the resolved recipe plait writes first, with its
    header (a folder of a user's own ``metrics.jsonl`` or ``summary.txt`` is not a run)."""
    names = _entries(path)
    if kind == "run":
        return bool(names) and set(names) <= RUN_ENTRIES and _written_recipe(path / "recipe.yaml")
    if kind == "checkpoints":
        return bool(names) and all(n.startswith("step-") and (path / n).is_dir() for n in names)
    return False


def _written_recipe(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as f:
            return f.readline().startswith(RUN_RECIPE_HEADER)
    except (OSError, UnicodeDecodeError):
        return False


def classify(path: str | Path, kind: Kind) -> Literal["absent", "empty", "ours", "foreign"]:
    """What ``path`` is, seen as a target for a ``kind`` directory."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return "absent"
    if not path.is_dir():
        return "foreign"
    if not _entries(path) or all(_empty_dir(path / n) for n in _entries(path)):
        # only empty folders (another host's ranks of a multi-host job probe and create the run's
        # subdirectories on a shared file system before rank 0 claims it): nothing to lose
        return "empty"
    found = read_kind(path)
    if found is not None:
        return "ours" if found == kind else "foreign"
    return "ours" if _looks_like(path, kind) else "foreign"


def _describe(path: Path) -> str:
    if not path.is_dir():
        return "is a file, not a directory"
    found = read_kind(path)
    if found is not None:
        return f"is {_KIND_TEXT[found]}"
    names = _entries(path)
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} entries)" if len(names) > 4 else "")
    return f"is not empty and was not written by plait (it holds {shown})"


def require_target(path: str | Path, kind: Kind, *, what: str, replace: bool = False,
                   replace_hint: str = "") -> Literal["absent", "empty", "ours"]:
    """Check that ``path`` may receive a ``kind`` directory; returns its state.

    ``replace``: for a model directory, whether a previous plait model there may be replaced
    (without it, even plait's own model directory is refused: replacing is a decision the user
    makes). ``what`` names the setting in the message (``checkpoint.dir``, ``DEST`` ...).
    """
    path = Path(path)
    state = classify(path, kind)
    if state == "foreign":
        raise OutputDirError(f"{_named(what, path)} {_describe(path)}; plait writes {_KIND_TEXT[kind]} there only "
                             f"when it is absent or empty: choose another directory")
    if state == "ours" and kind == "hf-model" and not replace:
        raise OutputDirError(f"{_named(what, path)} already holds a Hugging Face model written by plait; "
                             f"{replace_hint or 'choose another directory'} to replace it")
    return state


def _named(what: str, path: Path | str) -> str:
    """``setting=path`` for a recipe field or command argument, ``the thing path`` otherwise."""
    return f"{what}={path}" if "." in what or what.isupper() else f"{what} {path}"


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


def is_within(inner: str | Path, outer: str | Path) -> bool:
    """True when ``inner`` is ``outer`` or lies below it (after resolving links)."""
    a, b = _resolved(inner), _resolved(outer)
    return a == b or b in a.parents


def require_not_containing(target: str | Path, protected: Iterable[tuple[str, str | Path]], *, what: str) -> None:
    """Refuse a ``target`` that is, or contains, one of the ``(name, path)`` directories it must not replace."""
    for name, path in protected:
        if path is not None and is_within(path, target):
            raise OutputDirError(f"{_named(what, target)} contains {name} ({path}); writing it would replace "
                                 f"{name}: choose a directory outside it")


def require_apart(target: str | Path, inputs: Iterable[tuple[str, str | Path | None]], *, what: str) -> None:
    """The rule every command that writes applies to its inputs: ``target`` may not be, contain, or
    lie inside any ``(name, path)`` it reads (a base model, an adapter, ``lora.init_from``,
    ``model.hf_path``, data, a tokenizer), with or without ``--overwrite``. Writing over an input
    would destroy it; writing inside one would change what the next reader of it sees."""
    for name, path in inputs:
        if path is None or not Path(path).expanduser().exists():
            continue
        if is_within(path, target):
            relation = "is" if _resolved(path) == _resolved(target) else "contains"
            raise OutputDirError(f"{_named(what, target)} {relation} {name} ({path}), which this command reads; "
                                 f"writing there would replace it: choose a directory outside it")
        if is_within(target, path):
            raise OutputDirError(f"{_named(what, target)} lies inside {name} ({path}), which this command reads; "
                                 f"write the output outside it")


def probe_writable(path: str | Path, *, what: str, target: str | Path | None = None) -> None:
    """Create ``path`` (and its parents) and write a file in it, so an unwritable place fails now.

    ``target``: the setting's own value when ``path`` is the directory it will be written in
    (a model directory is written beside its final place, then renamed); the message names it.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".plait-probe-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"plait")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        where = f" (in {path})" if target is not None else ""
        raise OutputDirError(f"{_named(what, target if target is not None else path)} cannot be written{where} "
                             f"({reason}); choose a writable directory") from None
