"""What a training checkpoint of a run holds, writing it, and putting it back into a run of any layout.

Beside :class:`~plait.train.run_state.RunState`, which it adapts to the checkpoint format
(:mod:`plait.checkpoint`, which knows no run).

Saved: the weights (and bf16-mixed master weights), the AdamW moments keyed by parameter name,
the optimizer step count (which is also the learning-rate scheduler's position and the data
sampler's: batches are a pure function of the step), every rank's RNG states, the resolved
recipe and the layout. Restoring continues the run exactly: the next step sees the same batch,
learning rate and optimizer state, and (under the same layout) the same dropout masks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.checkpoint.contents import CONTENTS_KEY, contents_of, model_config_dict, resume_problems, saved_contents
from plait.checkpoint.format import CheckpointError
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.writer import CheckpointWriter, checkpointed_buffers
from plait.parallel_state import named_parameters_with_specs
from plait.train.run_state import RunState


def layout_of(state: RunState) -> dict[str, Any]:
    r, p = state.recipe, state.recipe.parallel
    level = p.zero_level() if state.dp.size > 1 else 0
    layout = {"world_size": state.world, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp": state.dp.size,
              "zero1": level == 1, "kv_replication": state.mesh.kv_replication,
              "sequence_parallel": p.sequence_parallel, "precision": r.precision.preset}
    if level >= 2:  # only then: layouts written before levels 2 and 3 existed compare equal as they were
        layout["zero"] = level
    return layout


def rng_states(state: RunState) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    tracker = getattr(state.stages[0], "rng_tracker", None)
    if tracker is not None:
        for dev, dev_state in tracker.get_state().items():
            states[f"tracker/{dev}"] = dev_state
    return states


def checkpoint_meta(state: RunState, step: int) -> dict[str, Any]:
    return {"layout": layout_of(state), "recipe": state.resolved.as_recipe().model_dump(mode="json"),
            "optimizer_step": state.optimizer.step_count(), "train_step": step,
            "model_config": model_config_dict(state.config), "model_family": type(state.config).family,
            CONTENTS_KEY: contents_of(state.recipe)}


def save_checkpoint(state: RunState, writer: CheckpointWriter, step: int, attachments: dict[str, Path], *,
                    asynchronous: bool) -> float:
    """Snapshot this rank's state after ``step`` and write it (in the background when
    ``asynchronous``); returns the seconds the training loop was held up. ``attachments``: files
    travelling with the checkpoint (tokenizer, chat template: plait convert writes them out)."""
    start = time.perf_counter()
    snap = writer.snapshot(step, state.stages, state.optimizer, state.mesh, checkpoint_meta(state, step),
                           rng_states(state), attachments)
    if asynchronous:
        writer.write_async(snap)
    else:
        writer.write(snap)
    return time.perf_counter() - start


@torch.no_grad()
def restore(state: RunState, directory: str | Path) -> int:
    """Load ``directory`` into the run's stages and optimizer (any layout); returns the step to resume at."""
    with CheckpointReader(directory) as reader:
        problems = resume_problems(saved_contents(reader.manifest), state.recipe)
        if problems:
            raise CheckpointError(f"{directory} cannot continue this recipe: " + "; ".join(problems))
        # the trained parameters come from the checkpoint; frozen ones (a LoRA run's base) stay as
        # the run built them from its base, which the check above found to be the checkpoint's
        params = [entry for entry in named_parameters_with_specs(state.stages) if entry[2].requires_grad]
        opt = state.optimizer
        reader.check_model({name: tuple(spec.full_shape) if spec is not None else tuple(opt.local_shape(p))
                            for _, name, p, spec in params})
        step = int(reader.manifest.get("train_step", reader.step))
        for name, buf in checkpointed_buffers(state.stages):  # kept as they are when the checkpoint has none
            if reader.has("buffer", name):
                reader.read_into("buffer", name, buf)
        with_state = all(reader.has("exp_avg", name) for _, name, _, _ in params)
        opt_step = int(reader.manifest.get("optimizer_step", step))
        by_name = {name: (p, spec) for _, name, p, spec in params}
        # ZeRO-3: one bucket gathered at a time while it is read into, its owned chunk taken after
        for entries in opt.weights_in_turn(write_back=True):
            for entry in entries:
                p, spec = by_name[entry.name]
                reader.read_into("master" if reader.has("master", entry.name) else "model", entry.name, p, spec)
                if not with_state:
                    continue
                moments = {}
                for kind in ("exp_avg", "exp_avg_sq", "master"):
                    if kind == "master" and not (opt.has_master and reader.has("master", entry.name)):
                        continue
                    buf = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    reader.read_into(kind, entry.name, buf, spec)
                    moments[kind] = buf
                opt.load_param_state(entry.name, moments, opt_step)
            if not with_state:
                opt.sync_master_from_weights({e.name for e in entries})
        same_layout = reader.manifest.get("layout") == layout_of(state)
        if same_layout:
            rng = reader.read_rng(state.rank)
            if "cpu" in rng:
                torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            tracker = getattr(state.stages[0], "rng_tracker", None)
            tracked = {k[len("tracker/"):]: v for k, v in rng.items() if k.startswith("tracker/")}
            if tracker is not None and tracked:
                tracker.set_state(tracked)
    if step > state.recipe.train.steps:
        raise CheckpointError(f"{directory} is at step {step}, beyond train.steps={state.recipe.train.steps}; "
                              f"raise train.steps to continue training")
    return step


class RunCheckpoints:
    """The run's checkpoints: ``writer`` under ``checkpoint.dir``'s save directory, saved
    asynchronously unless asked otherwise, every one carrying ``attachments``."""

    def __init__(self, state: RunState, writer: CheckpointWriter, attachments: dict[str, Path], *,
                 asynchronous: bool) -> None:
        self.state, self.writer, self.attachments, self.asynchronous = state, writer, attachments, asynchronous

    def save(self, step: int, *, sync: bool = False, writer: CheckpointWriter | None = None) -> float:
        """Save after ``step``; returns the seconds the loop was held up. ``writer``: another root."""
        return save_checkpoint(self.state, writer or self.writer, step, self.attachments,
                               asynchronous=self.asynchronous and not sync)

    def finish(self) -> None:
        """Wait for the background save; every rank returns only after the checkpoint is committed."""
        self.writer.wait()
        if self.state.world > 1:
            dist.barrier(group=self.state.control)
