"""Preference training wired into the one training path: the head on the last stage, the reference model.

:func:`preference_head` makes the :class:`~plait.post_training.head.PreferenceHead` the runtime's
hooks give the last stage (its loss from its logits) and, for DPO and IPO, :func:`reference_pass_for`
the reference pass that runs before every schedule, training and evaluation alike, over the same
batch and through the same pipeline:

* ``adapters_off`` (LoRA): the policy's own stages with every adapter disabled
  (:func:`plait.lora.adapters_disabled`), forward only through the same runtime. The base weights
  never train, so this is exactly the initial model, with no second copy in memory.
* ``frozen``: a second copy of the stages, built and loaded exactly like the policy's at the start
  (same initialisation or the same ``model.hf_path``; without adapters, which start at zero), cast
  to the policy's parameter dtype, with no gradients and no optimizer, driven by its own
  forward-only runtime over the same layout.

* ``precompute``: no pass in the step; the batches carry the initial model's sums, scored once
  and stored with the prepared data (:mod:`plait.train.reference_precompute`).

GRPO's KL reference (``grpo.kl_coef > 0``) uses the same two passes with the GRPO head
(:func:`reference_mode_of`).

Both passes run in eval mode (no dropout), so the reference is deterministic and draws nothing
from the generators the policy's dropout uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from plait.config.resolve import ResolvedRecipe
from plait.config.schema import PREFERENCE_OBJECTIVES
from plait.data.batch import TokenBatch
from plait.lora import adapters_disabled
from plait.mesh import ParallelMesh
from plait.pipeline.hooks import LossHead, ReferencePass, RuntimeHooks
from plait.pipeline.runtime import PipelineRuntime
from plait.post_training.head import PreferenceHead
from plait.post_training.objectives import PreferenceSettings
from plait.precision import PrecisionPolicy


def preference_settings(resolved: ResolvedRecipe) -> PreferenceSettings:
    pr = resolved.recipe.preference
    return PreferenceSettings(beta=pr.beta, label_smoothing=pr.label_smoothing, sft_weight=pr.sft_weight,
                              gamma=pr.gamma)


@contextlib.contextmanager
def eval_mode(stages: list[nn.Module]) -> Iterator[None]:
    """The stages in eval mode (no dropout) inside; their previous modes restored after."""
    modes = [m.training for stage in stages for m in stage.modules()]
    for stage in stages:
        stage.eval()
    try:
        yield
    finally:
        for module, mode in zip((m for stage in stages for m in stage.modules()), modes, strict=True):
            module.training = mode


class ReferenceCollector(LossHead, Protocol):
    """A loss head that stores the reference model's log-probabilities of the micro-batches bound
    inside :meth:`collecting_reference` (the preference head, the GRPO head)."""

    def collecting_reference(self) -> AbstractContextManager[None]: ...


class AdaptersOffPass:
    """``adapters_off``: the policy's own stages with every adapter disabled, forward only through
    the runtime that is about to run the step."""

    def __init__(self, head: ReferenceCollector) -> None:
        self.head = head

    def __call__(self, runtime: PipelineRuntime, tokens: TokenBatch) -> None:
        stages = runtime.stages
        with adapters_disabled(stages), eval_mode(stages), self.head.collecting_reference():
            runtime.execute(tokens, train=False)


class FrozenPass:
    """``frozen``: the reference copy's own forward-only runtime over the same layout."""

    def __init__(self, reference: PipelineRuntime, head: ReferenceCollector) -> None:
        self.reference, self.head = reference, head

    def __call__(self, runtime: PipelineRuntime, tokens: TokenBatch) -> None:  # noqa: ARG002 - its own runtime
        with eval_mode(self.reference.stages), self.head.collecting_reference():
            self.reference.execute(tokens, train=False)


def freeze(stages: list[nn.Module], dtype: torch.dtype) -> list[nn.Module]:
    """``stages`` as a frozen reference: the policy's parameter dtype, no gradients."""
    for stage in stages:
        stage.to(dtype)
        for p in stage.parameters():
            p.requires_grad_(False)
    return stages


def preference_head(resolved: ResolvedRecipe, mesh: ParallelMesh, vocab_size: int,
                    device: torch.device) -> PreferenceHead | None:
    """The recipe's preference objective's loss head on the last stage; ``None`` for the other objectives."""
    r = resolved.recipe
    objective = r.train.objective
    if objective not in PREFERENCE_OBJECTIVES:
        return None
    return PreferenceHead(objective, preference_settings(resolved), vocab_size=vocab_size, tp=mesh.info("tp"),
                          microbatches=r.parallel.microbatches, dp_size=mesh.info("dp").size, device=device)


def reference_mode_of(resolved: ResolvedRecipe) -> str | None:
    """The reference model the objective trains against: a preference objective's
    (``preference.reference``), GRPO's KL reference (``grpo.reference``, none without a KL term),
    ``None`` for the others."""
    r = resolved.recipe
    if r.train.objective == "grpo":
        return r.grpo.reference_mode(r.lora.rank)
    return r.preference.reference_mode(r.train.objective, r.lora.rank)


def reference_pass_for(resolved: ResolvedRecipe, head: ReferenceCollector, mesh: ParallelMesh,
                       policy: PrecisionPolicy, hidden_size: int,
                       precision_context: Callable[[], AbstractContextManager[object]],
                       reference_stages: list[nn.Module] | None) -> ReferencePass | None:
    """The reference model's pass before every schedule (see the module doc); ``None`` for
    ``precompute`` (the batches carry the table's sums) and the objectives without a reference.
    ``reference_stages``: the frozen copy, for ``reference: frozen``."""
    r = resolved.recipe
    p = r.parallel
    mode = reference_mode_of(resolved)
    if mode == "adapters_off":
        return AdaptersOffPass(head)
    if mode == "frozen":
        assert reference_stages is not None, "build_run builds the frozen reference for reference: frozen"
        reference = PipelineRuntime(reference_stages, mesh, schedule=p.schedule, microbatches=p.microbatches,
                                    micro_batch_size=r.data.micro_batch_size, seq_len=r.data.seq_len,
                                    hidden_size=hidden_size, sequence_parallel=p.sequence_parallel,
                                    dtype=policy.param_dtype, precision_context=precision_context,
                                    hooks=RuntimeHooks(loss_head=head))
        return FrozenPass(reference, head)
    if mode not in (None, "precompute"):
        raise ValueError(f"preference.reference={mode!r} is not a reference mode; use frozen, adapters_off or "
                         f"precompute")
    return None
