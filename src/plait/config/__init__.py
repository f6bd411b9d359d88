"""Typed, validated training recipes.

A recipe is a YAML file of sections (``run``, ``model``, ``parallel``, ``precision``,
``optimizer``, ``scheduler``, ``data``, ``train``, ``checkpoint``, ``logging``); every field has a
default, so no file at all is the built-in default. ``load_recipe`` reads one and applies
``section.field=value`` overrides, ``validate_recipe`` checks it for a world size and returns the
:class:`ResolvedRecipe` with the derived values, or raises :class:`RecipeError` listing every
problem, one per line. See ``docs/recipes.md``.
"""

from plait.config.load import (
    apply_overrides,
    load_recipe,
    load_recipe_text,
    parse_override,
    parse_recipe,
    recipe_data,
    recipe_to_yaml,
)
from plait.config.problems import Problem, RecipeError
from plait.config.resolve import ModelNumbers, ResolvedRecipe, model_flops_per_token
from plait.config.schema import (
    CheckpointSection,
    DataSection,
    LoggingSection,
    ModelSection,
    OptimizerSection,
    ParallelSection,
    PrecisionSection,
    Recipe,
    RunSection,
    SchedulerSection,
    TrainSection,
)
from plait.config.validate import check_recipe, validate_recipe

__all__ = [
    "CheckpointSection", "DataSection", "LoggingSection", "ModelNumbers", "ModelSection", "OptimizerSection",
    "ParallelSection", "PrecisionSection", "Problem", "Recipe", "RecipeError", "ResolvedRecipe", "RunSection",
    "SchedulerSection", "TrainSection", "apply_overrides", "check_recipe", "load_recipe", "load_recipe_text",
    "model_flops_per_token", "parse_override", "parse_recipe", "recipe_data", "recipe_to_yaml", "validate_recipe",
]
