"""A rank's trained model as one typed object: what the loop, the checkpoint writer and reader,
evaluation and the end-of-run outputs consume (nothing receives "the whole trainer"), with the
run's objective and plug-ins (:mod:`plait.train.plugins`).

:func:`plait.train.build_run.build_run` is the only function that makes one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from plait.comm.primitives import GroupInfo
from plait.config.resolve import ResolvedRecipe
from plait.config.schema import Recipe
from plait.data.mixture import MixtureDataset
from plait.data.prompt_prepare import PromptDataset
from plait.data.sft_prepare import RowDataset
from plait.data.token_shards import TokenDataset
from plait.data_parallel.optimizer import DistributedOptimizer
from plait.mesh import ParallelMesh
from plait.models.decoder.config import DecoderConfig
from plait.pipeline.runtime import PipelineRuntime
from plait.precision import PrecisionPolicy
from plait.train.plugins import Objective, StepPlugin

#: a split of the run's data: text sequences, or fine-tuning rows
Dataset = TokenDataset | MixtureDataset | RowDataset | PromptDataset


@dataclass
class RunState:
    """Everything one rank trains with. ``stages`` is always a list (one stage without PP)."""

    resolved: ResolvedRecipe
    rank: int
    world: int
    device: torch.device
    mesh: ParallelMesh
    policy: PrecisionPolicy
    config: DecoderConfig
    stages: list[nn.Module]
    runtime: PipelineRuntime
    optimizer: DistributedOptimizer
    scheduler: LambdaLR
    train_data: Dataset
    val_data: Dataset
    #: seed of the global generator on this rank (dropout on replicated activations)
    dropout_seed: int
    #: a gloo group for host-side agreement (preemption) that never touches the accelerator
    control: dist.ProcessGroup | None
    #: ``train.objective``'s loop hooks: its validation scores and interval metrics
    objective: Objective
    #: the stateful features' loop hooks, called in this order (MoE statistics, compile timing, ...)
    plugins: list[StepPlugin]
    #: the optimizer step the run starts at (0, or the resumed checkpoint's)
    start_step: int = 0

    @property
    def recipe(self) -> Recipe:
        return self.resolved.recipe

    @property
    def tp(self) -> GroupInfo:
        return self.mesh.info("tp")

    @property
    def dp(self) -> GroupInfo:
        return self.mesh.info("dp")

    @property
    def pp(self) -> GroupInfo:
        return self.mesh.info("pp")
