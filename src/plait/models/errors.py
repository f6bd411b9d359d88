"""The error of a model configuration that cannot describe a model plait can build."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """A model configuration that cannot describe a valid model (a family's config, a ``config.json``,
    a recipe's ``model`` section); the message names the field, the value and the fix."""


__all__ = ["ModelConfigError"]
