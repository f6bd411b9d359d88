"""``train.compile`` (kept apart from :mod:`plait.train.compile`, which imports dynamo, so that
checking a recipe stays cheap).

``train.compile`` covers dense models with tensor, sequence, pipeline (non-split schedules) and
data parallelism, ZeRO-1, activation checkpointing, LoRA and dropout, and MoE models (their MoE
layers run eagerly, also under expert parallelism), each checked against eager mode
(tests/test_compile.py). Layouts it has not been checked with are refused up front rather
than left to fail inside a compiled graph; no architecture is refused today.
"""

from __future__ import annotations

from plait.config.rules.checker import Checker
from plait.pipeline.schedules import INTERLEAVED_SCHEDULES, SPLIT_BACKWARD_SCHEDULES


def check_compile(c: Checker) -> None:
    if not c.ok("train.compile", "train.compile_mode", "parallel.schedule", "parallel.cp"):
        return
    t, p = c.r.train, c.r.parallel
    if not t.compile:
        if t.compile_mode != "default":
            c.add("train.compile_mode", t.compile_mode, "is used only with train.compile=true; set "
                                                        "train.compile=true or remove compile_mode")
        return
    if p.schedule in SPLIT_BACKWARD_SCHEDULES:
        unsplit = "interleaved-1f1b" if p.schedule in INTERLEAVED_SCHEDULES else "1f1b"
        c.add("parallel.schedule", p.schedule, f"is not supported with train.compile=true yet (its deferred weight "
                                               f"gradients are untested under compile); use {unsplit!r} or set "
                                               f"train.compile=false")
    if p.cp > 1:
        c.add("parallel.cp", p.cp, "context parallelism is not supported with train.compile=true yet; use cp=1 or "
                                   "set train.compile=false")
