"""A rank's run as one typed object: what the loop, the checkpoint writer and reader, evaluation
and the end-of-run outputs consume (nothing receives "the whole trainer").

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
from plait.data.sft_prepare import RowDataset
from plait.data.token_shards import TokenDataset
from plait.data_parallel.optimizer import DistributedOptimizer
from plait.mesh import ParallelMesh
from plait.models.llama.config import LlamaConfig
from plait.pipeline.runtime import PipelineRuntime
from plait.post_training.head import PreferenceHead
from plait.precision import PrecisionPolicy

#: a split of the run's data: text sequences, or fine-tuning rows
Dataset = TokenDataset | RowDataset


@dataclass
class RunState:
    """Everything one rank trains with. ``stages`` is always a list (one stage without PP)."""

    resolved: ResolvedRecipe
    rank: int
    world: int
    device: torch.device
    mesh: ParallelMesh
    policy: PrecisionPolicy
    config: LlamaConfig
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
    #: the optimizer step the run starts at (0, or the resumed checkpoint's)
    start_step: int = 0
    #: the preference objective's head on the last stage (``None``: the next-token loss)
    preference: PreferenceHead | None = None
    #: the frozen reference model's stages (DPO/IPO with ``preference.reference: frozen``)
    reference_stages: list[nn.Module] | None = None

    @property
    def recipe(self) -> Recipe:
        return self.resolved.recipe

    @property
    def modules(self) -> list[nn.Module]:
        """The modules whose parameters this rank owns (its stages)."""
        return self.stages

    @property
    def tp(self) -> GroupInfo:
        return self.mesh.info("tp")

    @property
    def dp(self) -> GroupInfo:
        return self.mesh.info("dp")

    @property
    def pp(self) -> GroupInfo:
        return self.mesh.info("pp")

    @property
    def holds_last_stage(self) -> bool:
        return any(stage.last for stage in self.stages)
