"""One lm-eval evaluation of a model directory, in one process or over a tensor-parallel group.

:func:`evaluate_model` is the whole evaluation on one rank (model built on ``mesh``, tasks run,
metrics returned); :func:`evaluate_model_tp` starts ``tp`` local ranks (PyTorch's elastic
launcher, :func:`plait.launch.launch_local`), each running :func:`evaluate_model` on a TP mesh
of all of them, and returns rank 0's rows. The checks that need no model (the heads place over
the TP degree) run in the calling process first.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from plait.mesh import ParallelMesh

if TYPE_CHECKING:
    from plait.evaluation.harness import TaskMetric


@dataclass(frozen=True)
class EvalSpec:
    """What to evaluate: ``tasks`` (names or YAML paths), ``include`` (a directory of task YAMLs),
    ``limit`` (documents per task), ``batch_size``, ``num_fewshot`` (None: each task's own),
    ``base`` (the base model of an adapter directory), ``bootstrap_iters`` (resamples of
    the standard errors that need them)."""

    model: str
    tasks: tuple[str, ...]
    include: str | None = None
    limit: int | None = None
    batch_size: int = 8
    num_fewshot: int | None = None
    base: str | None = None
    bootstrap_iters: int | None = None


def tp_mesh(model_dir: str | os.PathLike, world: int, rank: int, *, create_groups: bool = True) -> ParallelMesh:
    """A mesh of ``world`` ranks, all tensor-parallel, with the KV replication the model's heads
    need at that degree. A degree the family's plan cannot split the model by (heads that cannot
    be placed, an MLP width it does not divide) is a ``ValueError`` naming it, raised here from the
    config alone, before any process group or weight."""
    from plait.models.hf_io import load_hf_config
    from plait.models.registry import family_of
    from plait.tensor_parallel.heads import HeadLayout

    config = load_hf_config(model_dir)
    layout = HeadLayout.plan(config.num_attention_heads, config.num_key_value_heads, config.head_dim, world)
    try:
        family_of(config).local_shapes(config, world, layout.kv_replication)
    except ValueError as e:
        raise ValueError(f"--tp {world} cannot split {model_dir}: {e}") from None
    return ParallelMesh(world, rank, tp=world, kv_replication=layout.kv_replication, create_groups=create_groups)


def evaluate_model(spec: EvalSpec, mesh: ParallelMesh | None = None) -> list[TaskMetric] | None:
    """The :class:`~plait.evaluation.harness.TaskMetric` rows of ``spec`` on this rank's shard of
    the model on ``mesh`` (default one process); every rank of a TP group calls it alike. None on
    the ranks lm-eval reports nothing to (under a launcher, those whose ``LOCAL_RANK`` is not 0)."""
    from plait.evaluation.harness import BOOTSTRAP_ITERS, run_tasks, task_manager
    from plait.evaluation.lm_eval_model import PlaitLM

    manager = task_manager(spec.tasks, spec.include)
    lm = PlaitLM(spec.model, base=spec.base, mesh=mesh, batch_size=spec.batch_size)
    done = run_tasks(lm, spec.tasks, manager, limit=spec.limit, num_fewshot=spec.num_fewshot,
                     bootstrap_iters=BOOTSTRAP_ITERS if spec.bootstrap_iters is None else spec.bootstrap_iters)
    return None if done is None else done[0]


def _config_dir(spec: EvalSpec) -> Path:
    """The directory whose config.json describes the model's shapes (an adapter's base)."""
    from plait.heldout import scoring_model_dir

    path, base_dir, _ = scoring_model_dir(spec.model, spec.base)
    return base_dir or path


def _tp_worker(spec: EvalSpec, out: str) -> None:
    """One rank of :func:`evaluate_model_tp`: the rank lm-eval reports to (local rank 0) writes the
    rows to ``out`` as JSON."""
    from plait.launch import finish_worker, init_worker

    rank, world = init_worker()
    if rank != 0:
        os.environ["TQDM_DISABLE"] = "1"  # one progress bar, rank 0's
    try:
        rows = evaluate_model(spec, tp_mesh(_config_dir(spec), world, rank))
        if rows is not None:
            Path(out).write_text(json.dumps([r.as_dict() for r in rows]), encoding="utf-8")
    finally:
        finish_worker()


def evaluate_model_tp(spec: EvalSpec, tp: int) -> list[TaskMetric]:
    """:func:`evaluate_model` over ``tp`` local tensor-parallel ranks (gloo on CPU, NCCL on
    CUDA); rank 0's rows."""
    from plait.evaluation.harness import TaskMetric as Row
    from plait.launch import launch_local

    tp_mesh(_config_dir(spec), tp, 0, create_groups=False)  # the model splits: checked here, once
    with tempfile.TemporaryDirectory(prefix="plait-eval-") as tmp:
        out = Path(tmp) / "rows.json"
        launch_local(_tp_worker, tp, spec, str(out))
        return [Row(**row) for row in json.loads(out.read_text(encoding="utf-8"))]


__all__ = ["EvalSpec", "evaluate_model", "evaluate_model_tp", "tp_mesh"]
