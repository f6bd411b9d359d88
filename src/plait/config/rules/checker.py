"""What every recipe rule receives: the recipe, what is already broken, and what earlier rules found.

A rule is a function ``rule(c: Checker) -> None`` (:data:`Rule`) that adds :class:`Problem` lines
with :meth:`Checker.add` and skips itself, with :meth:`Checker.ok`, when a field it needs is
already broken (reported as a type error or by an earlier rule), so one pass reports every
problem at once. The layout rule derives ``dp`` and the architecture rule the model config; the
rules after them read :attr:`Checker.dp` and :attr:`Checker.arch` (``None``: it could not be
derived).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plait.config.problems import Problem
from plait.config.schema import Recipe
from plait.models.decoder.config import DecoderConfig


class Checker:
    def __init__(self, recipe: Recipe, broken: set[str], *, world_size: int | None = None,
                 check_paths: bool = True) -> None:
        self.r = recipe
        self.broken = broken
        self.world_size = world_size
        #: whether the files ``data.source``, ``data.tokenizer`` and ``lora.init_from`` name are checked
        self.check_paths = check_paths
        self.problems: list[Problem] = []
        self.warnings: list[str] = []
        #: the data-parallel degree, set by the layout rule (``None``: it cannot be derived)
        self.dp: int | None = None
        #: the model's architecture, set by the architecture rule (``None``: it is invalid)
        self.arch: DecoderConfig | None = None

    def ok(self, *fields: str) -> bool:
        """True when none of ``fields`` (dotted paths; a section name covers its fields) is broken."""
        return not any(b == f or f.startswith(b + ".") or b.startswith(f + ".") for f in fields for b in self.broken)

    def add(self, field: str, value: Any, valid: str) -> None:
        self.problems.append(Problem(field, value, valid))
        self.broken.add(field)


#: one recipe rule
Rule = Callable[[Checker], None]
