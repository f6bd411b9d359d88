"""The ``plait`` command: ``train``, ``data prepare|task``, ``generate``, ``eval``, ``config show|validate``, ``plan``,
``convert``, ``import-nxdt``."""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand modules, each with ``add_parser(subparsers)`` and ``run(args) -> int``
COMMANDS = ("train", "data", "generate", "eval", "config", "plan", "convert", "import_nxdt", "launch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait",
        description="Distributed training of Llama-family models on PyTorch: one recipe on a laptop CPU, "
                    "a GPU box or a cluster.",
        epilog="Run 'plait COMMAND --help' for the options of each command.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"plait.commands.{name}")
        module.add_parser(sub).set_defaults(_module=module)
    return parser


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
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
