"""``plait import-nxdt CONFIG.yaml [-o RECIPE.yaml] [--force]``: an NxDT config as a plait recipe.

Without ``-o`` the recipe goes to standard output and the report to standard error, so
``plait import-nxdt c.yaml > recipe.yaml`` works; with ``-o`` the report goes to standard output.
Exit status 0 when a recipe was produced (keys that could not be mapped are listed under
"not mapped"); 2 with one line naming the file when the input is missing, not a mapping or not
an NxDT config, or when the output file exists and ``--force`` is not given (``--force`` replaces
only a file an earlier import wrote: its first line is the import's header).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "import-nxdt", help="convert a neuronx-distributed-training (NxDT) YAML config to a plait recipe",
        description="Read an NxDT config (trainer, exp_manager, distributed_strategy, data, model, precision) "
                    "and write the equivalent plait recipe, listing every key that was mapped, ignored (and "
                    "why) or could not be mapped. The recipe passes `plait config validate --nproc N "
                    "--no-path-checks` for its world size N = tp*pp*dp. See docs/nxdt.md.")
    p.add_argument("config", metavar="CONFIG.yaml", help="the NxDT YAML config")
    p.add_argument("-o", "--output", metavar="RECIPE.yaml", help="write the recipe here (default: standard output)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    return p


#: what the first line of every recipe this command writes says (see ImportResult.recipe_text)
IMPORT_MARKER = "by plait import-nxdt"


def _written_by_import(path: Path) -> bool:
    """``path`` is a regular file whose first line is this command's header (an earlier import)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return IMPORT_MARKER in f.readline()
    except OSError:
        return False


def _fail(message: str) -> int:
    print(f"plait import-nxdt: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    from plait.interop.nxdt import NxdtConfigError, import_nxdt, read_nxdt  # loads torch (see the package doc)

    out = Path(args.output) if args.output else None
    if args.force and out is None:
        return _fail("--force replaces the -o file; without -o the recipe goes to standard output: drop --force")
    if out is not None and out.exists() and not out.is_file():
        return _fail(f"{out}: not a file; give a file path to -o")
    if out is not None and out.exists() and not args.force:
        return _fail(f"{out}: exists; give --force to replace it, or another -o path")
    if out is not None and out.exists() and not _written_by_import(out):
        return _fail(f"{out}: exists and was not written by plait import-nxdt; plait does not replace it, even "
                     f"with --force: give another -o path, or move it away yourself")
    try:
        data = read_nxdt(args.config)
    except NxdtConfigError as e:
        return _fail(str(e))
    result = import_nxdt(data, Path(args.config).resolve().parent, source=str(args.config))
    text = result.recipe_text()
    if out is None:
        sys.stdout.write(text)
        sys.stderr.write(result.report())
        return 0
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        return _fail(f"{out}: cannot be written ({e.strerror or e})")
    sys.stdout.write(result.report())
    print(f"wrote {out}")
    return 0
