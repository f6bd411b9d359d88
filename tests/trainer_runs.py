"""Shared harness of the parity tests: train a recipe through the real trainer on N gloo ranks.

``run_recipe`` prepares the data once (in the parent), runs ``steps`` optimizer steps on every
rank and returns, per rank, the per-step losses, the per-step gradient norms and the full
(TP-gathered) weights of the stages the rank holds.
"""

from __future__ import annotations

import torch
import yaml

from distributed import run_distributed


def corpus_dir(tmp_path_factory):
    """Two Shakespeare plays, 60 kB each: real text, small enough for 20-step runs."""
    from plait.data.corpora import shakespeare_files

    d = tmp_path_factory.mktemp("corpus")
    for f in shakespeare_files()[:2]:
        (d / f.name).write_text(f.read_text(encoding="latin-1")[:60000], encoding="utf-8")
    return d


def train_and_gather(trainer, steps: int) -> dict:
    """``steps`` steps of ``trainer``: per-step losses and grad norms, and the full weights after."""
    from plait.parallel_state import full_state_dict

    batches, losses, norms = iter(trainer.run.loader), [], []
    for _ in range(steps):
        trainer.run_step(next(batches))
        read = trainer.run.metrics.read(average_over=trainer.state.dp, loss_from=trainer.state.pp)
        losses.append(read["loss"])
        norms.append(read["grad_norm"])
    trainer.run.loader.close()
    weights = {}
    with trainer.state.optimizer.weights_gathered():  # ZeRO-3 keeps only shards between steps
        for module in trainer.state.stages:
            weights.update({k: v.float() for k, v in full_state_dict(module, trainer.state.tp).items()})
    return {"losses": losses, "norms": norms, "weights": weights}


def _train_worker(rank, world, recipe_yaml, prepared, steps):
    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    return {**train_and_gather(trainer, steps), "memory": trainer.state.optimizer.memory_report()}


def run_recipe(corpus, out_dir, items: list[str], world: int, steps: int) -> list[dict]:
    """Train the default recipe with override ``items`` on ``world`` ranks; per-rank results."""
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = items + [f"data.source={corpus}", f"run.output_dir={out_dir}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    return run_distributed(_train_worker, world, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared,
                           steps)


def merged_weights(results: list[dict]) -> dict[str, torch.Tensor]:
    merged = {}
    for r in results:
        merged.update(r["weights"])
    return merged


def max_relative(values, reference) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))


def weight_errors(weights: dict, reference: dict) -> dict[str, float]:
    """||w - w_ref|| / ||w_ref|| per tensor (see tests/test_pipeline_parity.py for why norm-relative)."""
    assert set(weights) == set(reference), set(weights) ^ set(reference)
    return {k: ((weights[k] - ref).norm() / ref.norm().clamp(min=1e-12)).item() for k, ref in reference.items()}


def _checkpoint_worker(rank, world, recipe_yaml, prepared, steps, save_at):
    """Train ``steps`` steps (from a checkpoint when the recipe resumes), saving after step ``save_at``."""
    from plait.config import validate_recipe
    from plait.parallel_state import full_state_dict
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    batches, losses = iter(trainer.run.loader), []
    for step in range(trainer.state.start_step, trainer.state.start_step + steps):
        trainer.run_step(next(batches))
        losses.append(trainer.run.metrics.read(average_over=trainer.state.dp, loss_from=trainer.state.pp)["loss"])
        if step + 1 == save_at:
            trainer.save_checkpoint(step + 1)
    trainer.finish_checkpoints()
    trainer.run.loader.close()
    weights = {}
    with trainer.state.optimizer.weights_gathered():
        for module in trainer.state.stages:
            weights.update(full_state_dict(module, trainer.state.tp))
    return {"losses": losses, "weights": weights, "start": trainer.state.start_step}


def run_checkpointed(corpus, out_dir, items: list[str], world: int, steps: int, save_at: int = -1, *,
                     recipe: str | None = "default") -> list[dict]:
    """Like :func:`run_recipe`, saving a checkpoint after step ``save_at`` (the recipe may resume).

    ``recipe``: "default" = the built-in default recipe, ``None`` = the schema defaults only.
    """
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    base = DEFAULT_RECIPE if recipe == "default" else recipe
    items = items + [f"data.source={corpus}", f"run.output_dir={out_dir}"]
    prepared = str(prepare_data(load_recipe(base, items)))
    return run_distributed(_checkpoint_worker, world, yaml.safe_dump(recipe_data(base, items)), prepared,
                           steps, save_at)


def _eval_worker(rank, world, recipe_yaml, prepared):
    """The validation loss of the freshly built model (layout-invariant initial weights)."""
    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    trainer.run.loader.close()
    return trainer.evaluate()["val_loss"]


def run_eval(corpus, out_dir, items: list[str], world: int) -> list[float]:
    """Per-rank validation loss of the default recipe with overrides ``items`` at step 0 on ``world`` ranks."""
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = items + [f"data.source={corpus}", f"run.output_dir={out_dir}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    return run_distributed(_eval_worker, world, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared)


def train_then_sigterm(cmd: list[str], metrics, records: int = 3, timeout: float = 240.0) -> tuple[int, str]:
    """Start ``plait train`` (``cmd``), send SIGTERM once ``metrics`` holds ``records`` lines;
    ``(exit status, combined output)``."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= records):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out
