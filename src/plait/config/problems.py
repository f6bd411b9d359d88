"""How a recipe problem is written: the field's dotted path, its value and what would be valid.

Every check of a recipe (types, rules between fields, files, host memory) reports through these
types, so ``plait config validate``, ``plait train`` and the workers print one line per problem
in one form.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One invalid setting: the field's dotted path, its value and what would be valid."""

    field: str
    value: Any
    valid: str

    def __str__(self) -> str:
        return f"{self.field}: {format_value(self.value)} — {self.valid}"


class RecipeError(ValueError):
    """An invalid recipe. ``problems`` lists every problem; the message has one line per problem."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    @property
    def fields(self) -> list[str]:
        return [p.field for p in self.problems]


def problems_text(error: RecipeError) -> str:
    """What a command prints after ``plait COMMAND:`` for a refused recipe: one problem on the same
    line, several under a count, one line each."""
    n = len(error.problems)
    return str(error) if n == 1 else f"the recipe has {n} problems:\n{error}"


class Verbatim(str):
    """A problem value printed as is (not quoted)."""


def format_value(value: Any, limit: int = 80) -> str:
    """A value as written in a recipe: ``null``, ``true``, numbers plain, strings quoted."""
    if isinstance(value, Verbatim):
        return str(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, offered as the valid values of a degree that must divide it."""
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(name: str, choices: Iterable[str]) -> str | None:
    """The choice closest to a mistyped ``name``, for a "did you mean" hint."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None
