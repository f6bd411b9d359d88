"""``plait config show [RECIPE] [--nproc N] [key=value ...]`` and ``plait config validate [RECIPE] ...``.

``show`` prints the resolved recipe as YAML (derived values filled in, so the output is itself a
recipe) followed by the derived numbers as comments. ``validate`` prints ``ok``, or every
problem, one per line, and exits with status 2. Neither starts a process or touches the data.
Without a recipe both take the built-in default, as ``plait train`` does, including the layout
``plait train --nproc N`` would choose for it.
"""

from __future__ import annotations

import argparse
import sys

USAGE_ITEMS = "[RECIPE] [section.field=value ...]"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "config", help="show or validate a recipe",
        description="Show the resolved form of a recipe, or check it, without starting anything. "
                    "Overrides take the form section.field=value, e.g. parallel.tp=2 optimizer.lr=1e-3.")
    actions = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show", help="print the resolved recipe and its derived values (no recipe: the default)",
        description="Print the recipe with every field and derived value filled in, then the derived "
                    "numbers (dp, micro-batches, tokens per step, parameters, FLOPs per token).")
    validate = actions.add_parser(
        "validate", help="check a recipe (no recipe: the default): prints 'ok' or every problem (exit status 2)",
        description="Check a recipe for a world size; prints 'ok', or one line per problem and exits with 2. "
                    "With no recipe, the built-in default is checked.")
    for q in (show, validate):
        q.add_argument("--nproc", type=int, default=None, metavar="N",
                       help="world size to check against (default: tp*pp*dp of the recipe, dp=1 when unset)")
        q.add_argument("--no-path-checks", action="store_true",
                       help="do not check the data.source and data.tokenizer files, nor the model state "
                            "against this host's memory (a recipe for another machine)")
        q.add_argument("items", nargs=argparse.REMAINDER, metavar=USAGE_ITEMS,
                       help="an optional recipe file (default: the built-in one) followed by overrides")
    return p


def split_items(items: list[str], nproc: int | None,
                no_path_checks: bool = False) -> tuple[str | None, list[str], int | None, bool]:
    """``(recipe path or None, overrides, nproc, no_path_checks)``; the options may also appear
    among the items (argparse leaves them there once the first item is seen)."""
    recipe, overrides, rest = None, [], list(items)
    while rest:
        item = rest.pop(0)
        if item == "--no-path-checks":
            no_path_checks = True
        elif item == "--nproc" or item.startswith("--nproc="):
            value = item.partition("=")[2] if "=" in item else (rest.pop(0) if rest else "")
            try:
                nproc = int(value)
            except ValueError:
                raise ValueError(f"--nproc={value!r} must be an integer") from None
        elif item.startswith("-"):
            raise ValueError(f"unknown option {item!r}; options: --nproc N, --no-path-checks")
        elif "=" in item:
            overrides.append(item)
        elif recipe is None and not overrides:
            recipe = item
        else:
            raise ValueError(f"{item!r} is not of the form section.field=value (the recipe file comes first)")
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc={nproc} must be a positive integer")
    return recipe, overrides, nproc, no_path_checks


def _format_number(n: int) -> str:
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n} ({n / scale:.3g}{unit})"
    return str(n)


def render_show(resolved, recipe_path: str | None, overrides: list[str]) -> str:
    from plait.config import recipe_to_yaml

    source = recipe_path or "built-in default recipe"
    header = f"resolved recipe: {source}" + (f" + {' '.join(overrides)}" if overrides else "")
    lines = [recipe_to_yaml(resolved, header=header).rstrip("\n"), "", f"# derived (world size {resolved.world_size}):"]
    for key, value in resolved.derived().items():
        if key in ("parameters", "non_embedding_parameters", "flops_per_token", "flops_per_step"):
            value = _format_number(value)
        lines.append(f"#   {key}: {value}")
    if resolved.pp > 1:
        from plait.plan.pipeline_split import partition_for

        lines.append("# pipeline split:")
        lines.extend(f"#   {line}" for line in partition_for(resolved).describe().splitlines())
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from plait.checkpoint.preflight import check_outputs
    from plait.config import RecipeError, check_recipe
    from plait.config.load import DEFAULT_RECIPE
    from plait.config.problems import problems_text
    from plait.config.resolve import default_layout_for

    action = args.config_command
    try:
        recipe_path, overrides, nproc, no_path_checks = split_items(args.items, args.nproc, args.no_path_checks)
        layout = default_layout_for(recipe_path, overrides, nproc)
        if layout is not None:  # what `plait train --nproc N` would run (said once the recipe is checked)
            overrides = overrides + layout.overrides()
        resolved = check_recipe(recipe_path or str(DEFAULT_RECIPE), overrides, nproc, check_paths=not no_path_checks)
        if action == "validate" and not no_path_checks:
            check_outputs(resolved)  # the output directories' rules, reading only (plait train also locks)
    except RecipeError as e:
        print(f"plait config {action}: {problems_text(e)}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"plait config {action}: {e}", file=sys.stderr)
        return 2
    if layout is not None:
        print(f"plait config {action}: {layout.describe()}", file=sys.stderr)
    for warning in resolved.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if action == "validate":
        print("ok")
    else:
        sys.stdout.write(render_show(resolved, recipe_path, overrides))
    return 0
