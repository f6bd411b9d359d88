"""What a run plugs into the pipeline runtime, given once at construction as one typed object.

The runtime (:mod:`plait.pipeline.runtime`) only carries out a schedule's tasks. Everything a
feature needs from inside a step enters through :class:`RuntimeHooks`, so the runtime never
learns which feature is on:

* the data-parallel side's "last gradient comes next" markers (the optimizer then starts a
  stage's bucket reductions during its last backward; per parameter under a split backward);
* a sequence-level objective's ``loss_head`` (preference training) in place of the next-token loss;
* a ``reference_pass`` over each batch before the schedule (a reference model's forward);
* ``split_batch``, cutting each batch to this rank's share of the sequence (context parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from plait.data.batch import TokenBatch
from plait.nn.lm_output import SequenceLoss

if TYPE_CHECKING:  # the runtime passes itself to the reference pass
    from plait.pipeline.runtime import PipelineRuntime


class LossHead(Protocol):
    """What the last stage computes its loss with when it is not the next-token loss."""

    def bind(self, tokens: TokenBatch, microbatch: int, train: bool) -> SequenceLoss: ...


class ReferencePass(Protocol):
    """A forward-only pass over ``tokens`` (already on the device and split) before the schedule;
    given the runtime that is about to run, so a pass may reuse its stages (LoRA adapters off)."""

    def __call__(self, runtime: PipelineRuntime, tokens: TokenBatch) -> None: ...


@dataclass(frozen=True)
class RuntimeHooks:
    """Every hook is optional; the default runs plain next-token training with no data parallelism.

    ``before_last_backward(chunk)``: called just before ``chunk``'s last backward of a step (with
    a split-backward schedule and no ``mark_final_params``, before its last W instead).
    ``mark_final_params(params)``: with a split-backward schedule, called with the parameters whose
    next gradient is their last of the step, before the last B and the last W of each stage; takes
    precedence over ``before_last_backward`` for such schedules.
    ``loss_head``: the last stage's loss per micro-batch when it is not the output module's.
    ``reference_pass``: run over each batch before the schedule, training and evaluation alike.
    ``split_batch``: cuts each batch (on the device) to this rank's share of the sequence.
    """

    before_last_backward: Callable[[int], None] | None = None
    mark_final_params: Callable[[Sequence[torch.Tensor]], None] | None = None
    loss_head: LossHead | None = None
    reference_pass: ReferencePass | None = None
    split_batch: Callable[[TokenBatch], TokenBatch] | None = None
