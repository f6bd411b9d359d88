"""Keys set to something that cannot take effect for this recipe (the conditions the schema names:
:mod:`plait.config.applicability`)."""

from __future__ import annotations

from plait.config.applicability import inapplicable_fields
from plait.config.rules.checker import Checker


def check_applicability(c: Checker) -> None:
    if not c.ok("data.format", "data.source"):
        return
    for problem in inapplicable_fields(c.r):
        if c.ok(problem.field):
            c.add(problem.field, problem.value, problem.valid)
