"""The user errors of evaluation with lm-eval."""

from __future__ import annotations


class LmEvalError(ValueError):
    """An lm-eval request plait cannot serve as asked (an unknown task, a missing task directory, a
    generation keyword the engine does not understand), named with what is valid."""


__all__ = ["LmEvalError"]
