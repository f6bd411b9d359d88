"""The ``plait`` command: ``train``, ``data prepare|task``, ``generate``, ``eval``, ``config show|validate``, ``plan``,
``convert``, ``import-nxdt``, ``launch``.

Every command reports a problem with its inputs as one line on stderr, ``plait COMMAND: <what, where,
the fix>``, with exit status 2, and most of them do so themselves, naming the file or option they
were reading. What they do not catch, this entry point catches last (:func:`user_error_line`):
usage errors of the options, and errors of the user's files raised inside libraries (a missing or
unreadable file, bytes that are not UTF-8, broken JSON or YAML, a truncated binary file, a chat
template that does not compile). Anything else (an ``AssertionError``, a ``RuntimeError`` from
torch) is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import struct
import sys
import traceback
from typing import NoReturn

#: subcommand modules, each with ``add_parser(subparsers)`` and ``run(args) -> int``
COMMANDS = ("train", "data", "generate", "eval", "config", "plan", "convert", "import_nxdt", "launch")

#: (package, class name) of library exceptions that mean "this file is damaged or is not what it
#: should be" (subclasses included), and (what, fix) for the message; matched by name, so the
#: libraries need not be imported to recognise them
_LIBRARY_INPUT_ERRORS = {
    ("yaml", "YAMLError"): ("a file is not valid YAML", "fix it"),  # PyYAML
    ("ruamel", "YAMLError"): ("a file is not valid YAML", "fix it"),
    ("jinja2", "TemplateError"): ("a chat template does not compile or render", "fix or remove it"),
    ("safetensors", "SafetensorError"): ("a safetensors weights file is truncated or corrupt",
                                         "copy or convert it again"),
}
#: the attributes of the commands' arguments that hold their input paths, named in a message
#: about a file the error itself does not name
_INPUTS = ("source", "config", "data", "model", "run", "hf", "directory", "recipe")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (``plait generate: argument --top-k: invalid int
    value: 'x'; see plait generate --help``) instead of the usage block and the message."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {' '.join(message.split())}; see '{self.prog} --help'", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="plait",
        description="Distributed training of Llama-family models on PyTorch: one recipe on a laptop CPU, "
                    "a GPU box or a cluster.",
        epilog="Run 'plait COMMAND --help' for the options of each command.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")  # subparsers are _Parser too
    for name in COMMANDS:
        module = importlib.import_module(f"plait.commands.{name}")
        module.add_parser(sub).set_defaults(_module=module)
    return parser


def _raised_by_plait(exc: BaseException) -> bool:
    """The innermost frame of ``exc`` is plait's own code (a check of an input), not a library's."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE_DIR)


def _library_error(exc: BaseException) -> tuple[str, str] | None:
    """What :data:`_LIBRARY_INPUT_ERRORS` calls ``exc``, or None when it is none of them."""
    for cls in type(exc).__mro__:
        what = _LIBRARY_INPUT_ERRORS.get((cls.__module__.split(".")[0], cls.__name__))
        if what is not None:
            return what
    return None


def is_user_error(exc: BaseException) -> bool:
    """An error of the user's inputs rather than of plait: see the module doc."""
    if isinstance(exc, (OSError, UnicodeError, json.JSONDecodeError, struct.error)) or _library_error(exc):
        return True
    if isinstance(exc, ValueError):  # plait's own (DataError, RecipeError, ...) or a check in plait's code
        return type(exc).__module__.split(".")[0] == "plait" or _raised_by_plait(exc)
    return False


def _inputs(args: argparse.Namespace | None) -> list[str]:
    """The input paths a command was given (for errors that do not name their file)."""
    if args is None:
        return []
    found = [str(v) for v in (getattr(args, name, None) for name in _INPUTS) if isinstance(v, str) and v]
    items = getattr(args, "items", None)
    if items and isinstance(items[0], str) and "=" not in items[0] and not items[0].startswith("-"):
        found.append(items[0])  # the recipe of train / config / launch
    return found


def user_error_line(exc: BaseException, args: argparse.Namespace | None = None) -> str:
    """One line for a user error that no command caught, naming the file where the error does and
    the command's inputs where it does not."""
    text, unnamed = "", None  # unnamed: (what, fix) of an error that names no file
    if isinstance(exc, OSError) and exc.filename is not None:
        where = f"{exc.filename}: " if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}: "
        text = where + (exc.strerror or str(exc))
    elif isinstance(exc, UnicodeDecodeError):
        unnamed = (f"a file is not UTF-8 text (byte {exc.object[exc.start:exc.start + 1]!r} at offset "
                   f"{exc.start})", "save it as UTF-8")
    elif isinstance(exc, struct.error):
        unnamed = ("a binary file is truncated or malformed", "copy or write it again")
    else:
        unnamed = _library_error(exc)
        text = str(exc) or type(exc).__name__
    if unnamed is not None:
        inputs = _inputs(args)
        what, fix = unnamed
        detail = "" if isinstance(exc, UnicodeDecodeError) else f" ({exc})"
        text = (f"reading {', '.join(inputs)}: " if inputs else "") + f"{what}{detail}; {fix}"
    return "; ".join(" ".join(line.split()) for line in text.splitlines() if line.strip()) or type(exc).__name__


def _command_name(args: argparse.Namespace) -> str:
    parts = ["plait", str(getattr(args, "command", "") or "")]
    for sub in ("data_command", "config_command"):
        if getattr(args, sub, None):
            parts.append(getattr(args, sub))
    return " ".join(p for p in parts if p)


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C outside a training step (imports, loading, launching): no traceback
        print("plait: interrupted", file=sys.stderr, flush=True)
        return 130


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    # Overrides may come after options (`plait train --nproc 2 optimizer.lr=1e-3`); argparse leaves
    # such trailing positionals unparsed, so they are handed to the command's item list.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or not hasattr(args, "items")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.items = list(args.items) + extra
    try:
        return int(args._module.run(args) or 0)
    except Exception as exc:  # noqa: BLE001 - the last resort for user errors; anything else is re-raised
        if not is_user_error(exc):
            raise
        print(f"{_command_name(args)}: {user_error_line(exc, args)}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
