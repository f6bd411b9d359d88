"""Validation of a recipe: every problem at once, one line each, before anything starts.

:func:`validate_recipe` is pure: it reads at most a Hugging Face ``config.json``, checks that
the data source exists and is of a readable kind, loads a tokenizer file, and estimates the model
state against this host's memory; it creates no directory, process or process group. Problems
are reported as ``<field.path>: <value> — <what is valid>`` (:mod:`plait.config.problems`); type
errors found by pydantic are converted to the same form (:mod:`plait.config.parse`). When some
fields have type errors, the rules between fields (:mod:`plait.config.rules`) still run on the
rest of the recipe, skipping the rules that involve a broken field, so one pass reports
everything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from plait.config.host_memory import model_state_problem
from plait.config.load import recipe_data
from plait.config.parse import parse_recipe_partial
from plait.config.problems import Problem, RecipeError
from plait.config.resolve import ResolvedRecipe, resolve
from plait.config.rules import collect_problems
from plait.config.schema import Recipe
from plait.models.packaged import PackagedModelError, is_packaged_name, packaged_model_dir


def validate_recipe(recipe: Recipe | Mapping[str, Any], world_size: int | None = None, *,
                    check_paths: bool = True) -> ResolvedRecipe:
    """Check ``recipe`` for ``world_size`` processes and return its :class:`ResolvedRecipe`.

    ``recipe`` is a :class:`Recipe` or raw recipe data (a mapping, as read from YAML); raw data
    lets type errors and rule violations be reported together. ``world_size=None`` assumes
    ``tp * pp * (dp or 1)`` processes. ``check_paths=False`` (a recipe meant for another machine)
    skips the checks of the files ``data.source`` and ``data.tokenizer`` name and of the model
    state against this host's memory (:mod:`plait.config.host_memory`). Raises
    :class:`RecipeError` listing every problem.
    """
    broken: set[str] = set()
    problems: list[Problem] = []
    if not isinstance(recipe, Recipe):
        if not isinstance(recipe, Mapping):
            raise RecipeError([Problem("recipe", recipe, "must be a mapping of sections")])
        parsed, problems, broken = parse_recipe_partial(recipe)
        if parsed is None:
            raise RecipeError(problems)
        recipe = parsed
    recipe, packaged_problems = _with_packaged_model(recipe)
    problems += packaged_problems
    rule_problems, warnings, arch = collect_problems(recipe, world_size, broken, check_paths=check_paths)
    problems += rule_problems
    if problems:
        raise RecipeError(problems)
    hf_config = arch if recipe.model.hf_path is not None else None
    resolved = resolve(recipe, world_size, hf_config=hf_config, warnings=warnings)
    if check_paths:  # the memory of this host is the limit only for a recipe meant to run here
        problem = model_state_problem(resolved)
        if problem is not None:
            raise RecipeError([problem])
    return resolved


def _with_packaged_model(recipe: Recipe) -> tuple[Recipe, list[Problem]]:
    """``model.hf_path`` naming a packaged model (e.g. ``smollm2-135m-instruct``) replaced by its
    converted directory in the cache (converted on first use: :mod:`plait.models.packaged`), and
    ``data.tokenizer`` naming the same model by that directory's tokenizer.json."""
    name = recipe.model.hf_path
    if not is_packaged_name(name):
        return recipe, []
    assert name is not None
    try:
        path = packaged_model_dir(name, recipe.data.cache_dir)
    except PackagedModelError as e:
        return recipe, [Problem("model.hf_path", name, str(e))]
    model = recipe.model.model_copy(update={"hf_path": str(path)})
    data = recipe.data
    if data.tokenizer in (name, f"{name}/tokenizer.json"):
        data = data.model_copy(update={"tokenizer": str(path / "tokenizer.json")})
    return recipe.model_copy(update={"model": model, "data": data}), []


def check_recipe(path: str | None, overrides: Iterable[str] = (), world_size: int | None = None, *,
                 check_paths: bool = True) -> ResolvedRecipe:
    """Load ``path`` (``None`` = the default recipe) with ``overrides`` and validate it, reporting
    type errors and rule violations together. Returns the :class:`ResolvedRecipe`."""
    return validate_recipe(recipe_data(path, list(overrides)), world_size, check_paths=check_paths)
