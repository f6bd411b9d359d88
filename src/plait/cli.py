"""The ``plait`` command."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description="Distributed training of Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="2-process tensor-parallel training of a tiny Llama on Shakespeare")
    demo.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from plait.demo import DemoSettings, run_demo

        if args.steps < 1:
            print(f"plait demo: --steps={args.steps} must be a positive integer", file=sys.stderr)
            return 2
        run_demo(DemoSettings(steps=args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
