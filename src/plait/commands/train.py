"""``plait train [RECIPE] [--nproc N] [key.sub=value ...]``.

Started plainly, it validates the recipe, prepares the data once, and launches N local ranks
through PyTorch's elastic launcher. Started under ``torchrun`` (or SLURM, with MASTER_ADDR and
MASTER_PORT set), it joins that world instead. A bad recipe is rejected before any process or
process group starts.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", help="train a model from a recipe (no recipe: the built-in Shakespeare default)",
        description="Train from a YAML recipe. With no recipe, the built-in default: a small Llama on "
                    "Shakespeare with tensor parallelism over 2 processes. Overrides take the form "
                    "section.field=value, e.g. parallel.tp=2 optimizer.lr=1e-3.",
        epilog="Outputs go to run.output_dir: metrics.jsonl, tensorboard/, loss.png, summary.txt, "
               "sample.txt, recipe.yaml and final/ (a Hugging Face directory). Multi-node: "
               "torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
               "-m plait.cli train RECIPE (see docs/launching.md).")
    p.add_argument("items", nargs="*", metavar="[RECIPE] [key=value ...]",
                   help="an optional recipe file followed by overrides")
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes to launch (default: tp*pp*dp of the recipe, dp=1 when unset); "
                        "ignored under torchrun/SLURM, where the world size comes from the launcher")
    return p


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """``(recipe path or None, overrides)``; the recipe, if any, is the first item without '='."""
    recipe = None
    if items and "=" not in items[0]:
        recipe, items = items[0], items[1:]
    bad = [i for i in items if "=" not in i]
    if bad:
        raise ValueError(f"override {bad[0]!r} is not of the form section.field=value")
    return recipe, items


def default_nproc(data: dict) -> int:
    """tp * pp * dp of raw recipe data (dp = 1 when unset); bad values are left to validation."""
    p = data.get("parallel") or {}
    degrees = [p.get("tp", 1), p.get("pp", 1), p.get("dp") or 1]
    n = 1
    for d in degrees:
        n *= d if isinstance(d, int) and d > 0 else 1
    return n


def run(args) -> int:
    from plait.config import RecipeError, recipe_data, validate_recipe
    from plait.config.load import DEFAULT_RECIPE
    from plait.launch import in_launched_world, launched_rank, launched_world_size

    try:
        recipe_path, overrides = split_items(args.items)
        data = recipe_data(recipe_path or DEFAULT_RECIPE, overrides)
        if in_launched_world():
            world = launched_world_size()
        else:
            world = args.nproc if args.nproc is not None else default_nproc(data)
            if world < 1:
                raise ValueError(f"--nproc={world} must be a positive integer")
            from plait.config.resolve import default_layout_for

            layout = default_layout_for(recipe_path, overrides, args.nproc)
            if layout is not None:  # the built-in default follows --nproc; a user's recipe keeps its layout
                data = recipe_data(DEFAULT_RECIPE, overrides + layout.overrides())
                print(f"plait train: {layout.describe()}", flush=True)
        resolved = validate_recipe(data, world)  # type errors and cross-field rules reported together
    except (RecipeError, ValueError, FileNotFoundError) as e:
        print(f"plait train: the recipe cannot run:\n{e}", file=sys.stderr)
        return 2
    for warning in resolved.warnings:
        print(f"plait train: warning: {warning}", file=sys.stderr)
    from plait.outputs import OutputDirError
    from plait.outputs.preflight import claim_outputs

    try:
        # Held until this process ends: the launcher here, global rank 0 under torchrun/SLURM.
        locks = claim_outputs(resolved, lock=not in_launched_world() or launched_rank() == 0)
    except OutputDirError as e:
        print(f"plait train: {e}", file=sys.stderr)
        return 2
    try:
        return _prepare_and_launch(resolved, data, world)
    finally:
        for lock in locks:
            lock.release()


def _prepare_and_launch(resolved, data: dict, world: int) -> int:
    """Prepare the data once (in the parent) and start the ranks; exit status 2 for data errors."""
    from plait.config.load import dump_recipe_text
    from plait.launch import WorkersFailed, in_launched_world, launch_local
    from plait.train.entry import prepare_data, train_worker

    # The ranks receive the recipe as the user wrote it (file + overrides) and validate it again
    # for their world; defaults are not frozen in, so fields that come from model.hf_path stay free.
    text = dump_recipe_text(data)  # read back by the ranks with the recipe loader's own YAML 1.2 rules
    if not in_launched_world():
        try:
            prepare_data(resolved.recipe, progress=True)  # once, in the parent, before any rank starts
        except ValueError as e:  # DataError (source, prepared data, seq_len, vocabulary) or ModelConfigError
            print(f"plait train: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"plait train: {e}", file=sys.stderr)
            return 1
        print(f"launching {world} process(es): {resolved.summary_line()}", flush=True)
    try:
        launch_local(train_worker, world, text)
    except WorkersFailed as e:
        print(f"plait train: {e}", file=sys.stderr)
        return e.status
    return 0
