"""Recipe rules of ``train.compile`` (kept apart from :mod:`plait.train.compile`, which imports
dynamo, so that checking a recipe stays cheap).

``train.compile`` covers dense models with tensor, sequence, pipeline (non-split schedules) and
data parallelism, ZeRO-1, activation checkpointing, LoRA and dropout, and MoE models (their MoE
layers run eagerly, also under expert parallelism), each checked against eager mode
(tests/test_compile.py). Layouts it has not been checked with are refused up front rather
than left to fail inside a compiled graph.
"""

from __future__ import annotations

from typing import Any

from plait.config.problems import Problem
from plait.pipeline.schedules import INTERLEAVED_SCHEDULES, SPLIT_BACKWARD_SCHEDULES


def compile_problems(recipe: Any, arch: Any) -> list[Problem]:
    """Problems of ``train.compile``/``train.compile_mode`` with the rest of ``recipe`` (``arch``: the
    model config, ``None`` when it is itself broken; no architecture is refused today)."""
    t, p = recipe.train, recipe.parallel
    if not t.compile:
        if t.compile_mode != "default":
            return [Problem("train.compile_mode", t.compile_mode, "is used only with train.compile=true; set "
                                                                  "train.compile=true or remove compile_mode")]
        return []
    problems = []
    if p.schedule in SPLIT_BACKWARD_SCHEDULES:
        unsplit = "interleaved-1f1b" if p.schedule in INTERLEAVED_SCHEDULES else "1f1b"
        problems.append(Problem("parallel.schedule", p.schedule, f"is not supported with train.compile=true yet "
                                                                 f"(its deferred weight gradients are untested "
                                                                 f"under compile); use {unsplit!r} or set "
                                                                 f"train.compile=false"))
    if p.cp > 1:
        problems.append(Problem("parallel.cp", p.cp, "context parallelism is not supported with train.compile=true "
                                                     "yet; use cp=1 or set train.compile=false"))
    return problems
