"""The rules between a recipe's fields, one file per feature: the layout against the world size,
the architecture, heads against TP, batch, pipeline, precision, activation checkpointing, paths,
data and tokenizer, preference, GRPO, LoRA and its quantized base,
context parallelism, MoE, compile, trackers, and keys that cannot
take effect.

Every rule is a function ``rule(c: Checker) -> None`` (:mod:`plait.config.rules.checker`), and
:data:`RULES` runs them in order: the layout rule derives ``dp`` and the architecture rule the
model config for the rules after them. Each rule adds :class:`Problem` lines and skips itself
when a field it needs is already broken (reported as a type error), so one pass reports every
problem at once. A new rule is a function in its feature's file and one line in :data:`RULES`.
"""

from __future__ import annotations

from plait.config.problems import Problem
from plait.config.rules.applicability import check_applicability
from plait.config.rules.architecture import check_architecture
from plait.config.rules.checker import Checker, Rule
from plait.config.rules.compile import check_compile
from plait.config.rules.context_parallel import check_context_parallel
from plait.config.rules.data import check_data, check_fine_tuning
from plait.config.rules.grpo import check_grpo
from plait.config.rules.layout import check_batch, check_heads, check_layout, check_sequence
from plait.config.rules.lora import check_lora, check_lora_targets
from plait.config.rules.moe import check_moe
from plait.config.rules.pipeline import check_pipeline
from plait.config.rules.precision import check_zero_and_precision
from plait.config.rules.preference import check_preference
from plait.config.rules.quantize import check_quantize_base
from plait.config.rules.trackers import check_trackers
from plait.config.rules.training import check_activation_checkpointing, check_paths, check_schedule
from plait.config.schema import Recipe
from plait.models.decoder.config import DecoderConfig

#: every recipe rule, in the order it runs (the first two set ``Checker.dp`` and ``Checker.arch``)
RULES: tuple[Rule, ...] = (
    check_layout,
    check_architecture,
    check_heads,
    check_sequence,
    check_batch,
    check_schedule,
    check_pipeline,
    check_zero_and_precision,
    check_activation_checkpointing,
    check_paths,
    check_fine_tuning,
    check_preference,
    check_grpo,
    check_data,
    check_lora,
    check_lora_targets,
    check_quantize_base,
    check_context_parallel,
    check_moe,
    check_compile,
    check_trackers,
    check_applicability,
)


def collect_problems(recipe: Recipe, world_size: int | None, broken: set[str] | None = None, *,
                     check_paths: bool = True) -> tuple[list[Problem], list[str], DecoderConfig | None]:
    """``(problems, warnings, architecture)`` of the rules between fields, skipping rules that
    involve a field in ``broken`` (those already reported as type errors). ``check_paths=False``
    skips the checks of the files ``data.source`` and ``data.tokenizer`` name (a recipe meant for
    another machine); ``model.hf_path`` is always read, since the rules need its architecture."""
    c = Checker(recipe, set(broken or ()), world_size=world_size, check_paths=check_paths)
    for rule in RULES:
        rule(c)
    return c.problems, c.warnings, c.arch


__all__ = ["RULES", "Checker", "Rule", "collect_problems"]
