"""Subcommands of ``plait``: each module has ``add_parser(subparsers)`` and ``run(args) -> int``.

Their torch-heavy imports stay inside ``run`` (the exception to imports at module level): ``plait
--help`` and every parser are built without importing torch, which only the chosen command loads.
"""
