"""Reading recipes: YAML files, ``section.field=value`` overrides, and YAML output.

The YAML loader is PyYAML's safe loader with two changes: floats without a dot (``3e-3``) are
floats, as in YAML 1.2, and a key written twice in one mapping is an error instead of the last
one silently winning.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from plait.config.schema import SECTIONS, Recipe
from plait.config.validate import Problem, RecipeError, Verbatim, parse_recipe_partial


class RecipeLoader(yaml.SafeLoader):
    """Safe loader that reads ``1e-3`` as a float (YAML 1.2)."""


RecipeLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+][0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _duplicates(node: yaml.Node, path: str = "") -> list[Problem]:
    out: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key, line = key_node.value, key_node.start_mark.line + 1
            where = f"{path}.{key}" if path else str(key)
            if key in seen:
                shown = value_node.value if isinstance(value_node, yaml.ScalarNode) else "..."
                out.append(Problem(where, Verbatim(shown), f"written twice (lines {seen[key]} and {line}); keep one"))
            seen.setdefault(key, line)
            out += _duplicates(value_node, where)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out += _duplicates(item, f"{path}.{i}")
    return out


def parse_yaml(text: str, source: str = "<recipe>") -> Any:
    """Parse YAML text with :class:`RecipeLoader`; syntax errors and repeated keys raise :class:`RecipeError`."""
    try:
        node = yaml.compose(text, Loader=RecipeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        reason = getattr(e, "problem", None) or str(e)
        raise RecipeError([Problem(where, Verbatim("(file)"), f"not valid YAML: {reason}")]) from None
    if node is None:
        return None
    dups = _duplicates(node)
    if dups:
        raise RecipeError(dups)
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - RecipeLoader is a SafeLoader


def _as_mapping(data: Any, source: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise RecipeError([Problem(source, data, "a recipe must be a mapping of sections "
                                                 f"({', '.join(SECTIONS)})")])
    return {str(k): v for k, v in data.items()}


def read_recipe_file(path: str | Path) -> dict[str, Any]:
    """The raw data of a recipe file (an empty file is the default recipe)."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError([Problem("recipe", str(path), "no such file" if not p.exists() else "not a file")])
    return _as_mapping(parse_yaml(p.read_text(encoding="utf-8"), str(path)), str(path))


# ---------------------------------------------------------------------- overrides
def _field_type(parts: list[str]) -> tuple[bool, bool]:
    """``(is_str, nullable)`` for the schema field at ``section.field`` (False, False if unknown)."""
    if len(parts) != 2 or parts[0] not in SECTIONS:
        return False, False
    info = SECTIONS[parts[0]].model_fields.get(parts[1])
    if info is None:
        return False, False
    annotation = info.annotation
    if typing.get_origin(annotation) in (list, dict):  # list[str] is a list, not text
        return False, False
    args = typing.get_args(annotation) or (annotation,)
    return str in args or annotation is str, type(None) in args


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"parallel.tp=2"`` -> ``(["parallel", "tp"], 2)``.

    Values are parsed as YAML (``null``, ``true``, ``1e-3``, ``{rope_type: llama3, factor: 8}``),
    except for text fields, which take the text as written (``train.sample_prompt=ROMEO:``) unless
    it is quoted or ``null``.
    """
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise RecipeError([Problem("override", item, "must be section.field=value, e.g. parallel.tp=2")])
    parts = [p.strip() for p in parts]
    is_str, nullable = _field_type(parts)
    try:
        value = yaml.load(raw, Loader=RecipeLoader) if raw.strip() else ""  # noqa: S506
    except yaml.YAMLError:
        value = raw
    if is_str:
        quoted = raw.strip()[:1] in ("'", '"') and isinstance(value, str)
        if not quoted and not (nullable and value is None):
            value = raw
    return parts, value


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``section.field=value`` override applied, in order.

    Paths deeper than a field set keys inside a mapping field (``model.rope_scaling.factor=8``).
    """
    out = _deep_copy(dict(data))
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[:depth + 1])
                raise RecipeError([Problem(".".join(parts), value, f"{where} is {child!r}, not a mapping; "
                                                                   f"set {where}=... instead")])
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# ---------------------------------------------------------------------- recipes
#: The built-in default run (``plait train`` with no recipe), shipped inside the package.
DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "default.yaml"


def recipe_data(path: str | Path | None, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Raw recipe data: the file (``None`` = no file: every field at its schema default) plus overrides.

    The built-in default *run* (what ``plait train`` does without a recipe) is the file
    :data:`DEFAULT_RECIPE`; commands pass it explicitly.
    """
    base = read_recipe_file(path) if path is not None else {}
    return apply_overrides(base, overrides)


def parse_recipe(data: Mapping[str, Any]) -> Recipe:
    """Raw data to a :class:`Recipe`; type errors and unknown keys raise :class:`RecipeError`."""
    recipe, problems, _ = parse_recipe_partial(data)
    if problems or recipe is None:
        raise RecipeError(problems)
    return recipe


def load_recipe(path: str | Path | None, overrides: Iterable[str] = ()) -> Recipe:
    """Load a recipe file (``None`` = the built-in default) and apply ``section.field=value`` overrides.

    Raises :class:`RecipeError` for unreadable files, bad YAML, bad overrides, type errors and
    unknown keys. Rules between fields are checked by :func:`~plait.config.validate.validate_recipe`.
    """
    return parse_recipe(recipe_data(path, overrides))


def load_recipe_text(text: str, overrides: Iterable[str] = ()) -> Recipe:
    """Like :func:`load_recipe`, from YAML text (e.g. :func:`recipe_to_yaml` output)."""
    return parse_recipe(apply_overrides(_as_mapping(parse_yaml(text), "<recipe>"), overrides))


def recipe_to_yaml(recipe: Recipe | Any, *, header: str | None = None) -> str:
    """A recipe as YAML, every field written out; loads back to an equal recipe.

    Given a :class:`~plait.config.resolve.ResolvedRecipe`, writes its recipe with the derived
    values filled in (:meth:`~plait.config.resolve.ResolvedRecipe.as_recipe`).
    """
    if not isinstance(recipe, Recipe):
        recipe = recipe.as_recipe()
    text = yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, default_flow_style=False,
                          allow_unicode=True)
    if header:
        text = "".join(f"# {line}\n" for line in header.splitlines()) + text
    return text
