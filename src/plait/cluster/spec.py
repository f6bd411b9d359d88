"""What a cluster launch file describes: the recipe, the hosts and devices, and the rendezvous.

:func:`launch_spec` validates the recipe for the job's world size (and, for an elastic job, for
its smallest world size too) before anything is written, so a launch file never describes a run
that would be refused on the cluster. Every launch file resumes from the newest checkpoint
(``checkpoint.resume=auto``): a requeued or restarted job continues where it stopped.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from plait.config import recipe_data, validate_recipe
from plait.config.load import dump_recipe_text
from plait.config.resolve import ResolvedRecipe

#: the override every launch file adds: a restarted job continues from its newest checkpoint
RESUME = "checkpoint.resume=auto"
#: the first line after the shebang (or the first line) of every launch file plait writes; plait
#: replaces a file only while it still carries this text (see :mod:`plait.cluster.files`)
MARKER = "Written by `plait launch"


@dataclass(frozen=True)
class LaunchSpec:
    """One cluster job: ``nodes`` hosts (at least ``min_nodes`` for an elastic job) of ``gpus_per_node`` ranks."""

    recipe: str
    overrides: tuple[str, ...]
    recipe_text: str
    job_name: str
    nodes: int
    min_nodes: int
    gpus_per_node: int
    iface: str | None
    rdzv_port: int
    rdzv_timeout_s: float
    max_restarts: int
    save_every: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.nodes

    def train_arguments(self, recipe_path: str | None = None) -> list[str]:
        """``plait.cli train RECIPE overrides... checkpoint.resume=auto`` (``recipe_path`` replaces the recipe)."""
        return ["plait.cli", "train", recipe_path or self.recipe, *self.overrides, RESUME]

    def shell_train_arguments(self) -> str:
        return " ".join(shlex.quote(a) for a in self.train_arguments())


def _job_name(name: str) -> str:
    """``run.name`` as a job name valid in SLURM and Kubernetes (lower-case letters, digits and dashes)."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:52].strip("-")
    return cleaned or "plait"


def launch_spec(recipe: str, overrides: list[str], *, nodes: int, gpus_per_node: int, min_nodes: int | None = None,
                rdzv_port: int = 29500, max_restarts: int = 3) -> tuple[LaunchSpec, ResolvedRecipe]:
    """Check the job's numbers and the recipe for its world size(s); ``(spec, resolved recipe)``.

    Raises ``ValueError`` (:class:`~plait.config.RecipeError` for the recipe) naming the field or
    option, its value and the fix.
    """
    for option, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value < 1:
            raise ValueError(f"{option}={value} must be a positive integer")
    lowest = nodes if min_nodes is None else min_nodes
    if not 1 <= lowest <= nodes:
        raise ValueError(f"--min-nodes={lowest} must be between 1 and --nodes={nodes}")
    if not 1 <= rdzv_port <= 65535:
        raise ValueError(f"--rdzv-port={rdzv_port} must be a TCP port (1-65535)")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts={max_restarts} must be 0 or more")
    items = list(overrides)
    data = recipe_data(recipe, items + [RESUME])
    # the files data.source and data.tokenizer name live on the cluster, not necessarily here
    resolved = validate_recipe(data, nodes * gpus_per_node, check_paths=False)
    r = resolved.recipe
    if lowest < nodes:
        if r.parallel.dp is not None:
            raise ValueError(f"parallel.dp={r.parallel.dp} fixes the data-parallel degree, but an elastic job "
                             f"(--min-nodes {lowest} --nodes {nodes}) changes it with the hosts present; set "
                             f"parallel.dp=null (tp and pp stay fixed)")
        validate_recipe(data, lowest * gpus_per_node, check_paths=False)
    spec = LaunchSpec(recipe=recipe, overrides=tuple(items), recipe_text=dump_recipe_text(data),
                      job_name=_job_name(r.run.name), nodes=nodes, min_nodes=lowest, gpus_per_node=gpus_per_node,
                      iface=r.launch.iface, rdzv_port=rdzv_port, rdzv_timeout_s=r.launch.rdzv_timeout_s,
                      max_restarts=max_restarts, save_every=r.checkpoint.save_every)
    return spec, resolved
