"""Raw recipe data to a typed :class:`Recipe`, with pydantic's errors rewritten as problems.

A field with a type error is reported and then set back to its default, so the rules between
fields can still run on the rest of the recipe and one pass reports everything; the set of such
"broken" fields tells those rules what to skip.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from plait.config.problems import Problem, suggest
from plait.config.schema import SECTIONS, Recipe, nested_settings


def _field_default(section: str, name: str) -> tuple[bool, Any]:
    cls = SECTIONS.get(section)
    info = cls.model_fields.get(name) if cls is not None else None
    return (info is not None, None if info is None else info.default)


def _nested_model(loc: list[str]) -> type[BaseModel] | None:
    """The settings model held by the field at ``section.field`` (``logging.wandb``), else ``None``."""
    if len(loc) != 2 or loc[0] not in SECTIONS:
        return None
    info = SECTIONS[loc[0]].model_fields.get(loc[1])
    return nested_settings(info.annotation) if info is not None else None


def _type_text(err: ErrorDetails) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    texts = {
        "int_type": "must be an integer", "int_parsing": "must be an integer",
        "int_from_float": "must be an integer", "float_type": "must be a number",
        "float_parsing": "must be a number", "finite_number": "must be a finite number",
        "bool_type": "must be true or false (write true or false; yes/no/on/off are text)",
        "bool_parsing": "must be true or false (write true or false; yes/no/on/off are text)",
        "string_type": "must be a string", "string_too_short": "must not be empty",
        "dict_type": "must be a mapping", "model_type": "must be a mapping of fields",
        "model_attributes_type": "must be a mapping of fields", "list_type": "must be a list, e.g. [a, b]",
    }
    if kind in texts:
        return texts[kind]
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        key = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}[kind]
        return f"must be {bounds[kind]} {ctx.get(key)}"
    return err.get("msg", kind)


def problems_from_validation_error(error: ValidationError) -> tuple[list[Problem], set[str]]:
    """``(problems, broken)``: one :class:`Problem` per pydantic error, and the dotted paths of the
    fields whose value is unusable (for a typo'd key: the field it most likely meant)."""
    problems, broken = [], set()
    for err in error.errors():
        loc = [str(x) for x in err["loc"]]
        path = ".".join(loc)
        value = err.get("input")
        if err["type"] == "extra_forbidden" and len(loc) == 1:
            guess = suggest(loc[0], SECTIONS)
            hint = f"did you mean '{guess}'? " if guess else ""
            problems.append(Problem(path, value, f"unknown section; {hint}valid sections: {', '.join(SECTIONS)}"))
            if guess:
                broken.add(guess)
            continue
        if err["type"] == "extra_forbidden" and len(loc) == 2 and loc[0] in SECTIONS:
            names = list(SECTIONS[loc[0]].model_fields)
            guess = suggest(loc[1], names)
            hint = f"did you mean '{guess}'? " if guess else ""
            problems.append(Problem(path, value, f"unknown field of {loc[0]}; {hint}valid: {', '.join(names)}"))
            if guess:
                broken.add(f"{loc[0]}.{guess}")
            continue
        nested = _nested_model(loc[:-1]) if err["type"] == "extra_forbidden" and len(loc) == 3 else None
        if nested is not None:
            names = list(nested.model_fields)
            guess = suggest(loc[2], names)
            hint = f"did you mean '{guess}'? " if guess else ""
            problems.append(Problem(path, value, f"unknown field of {'.'.join(loc[:2])}; {hint}valid: "
                                                 f"{', '.join(names)}"))
            broken.add(".".join(loc[:2]))
            continue
        text = _type_text(err)
        settings = _nested_model(loc) if err["type"] in ("model_type", "model_attributes_type") else None
        if settings is not None:
            first = next(iter(settings.model_fields))
            text += f" (fields: {', '.join(settings.model_fields)}; e.g. {path}.{first}=...)"
        if len(loc) == 2:
            known, default = _field_default(*loc)
            if known and default is None and err["type"] != "literal_error":
                text += " or null"
        problems.append(Problem(path, value, text))
        broken.add(".".join(loc[:2]))
    return problems, broken


def _drop(data: dict[str, Any], paths: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` without the given section/field paths (so they take their defaults)."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for path in paths:
        parts = path.split(".")
        if len(parts) == 1:
            out.pop(parts[0], None)
        elif isinstance(out.get(parts[0]), dict):
            out[parts[0]].pop(parts[1], None)
    return out


def parse_recipe_partial(data: Mapping[str, Any]) -> tuple[Recipe | None, list[Problem], set[str]]:
    """Parse raw recipe data; on type errors also return the recipe with the bad fields at their
    defaults (``None`` if even that fails) and the set of broken field paths."""
    try:
        return Recipe.model_validate(dict(data)), [], set()
    except ValidationError as e:
        problems, broken = problems_from_validation_error(e)
        bad = {".".join(str(x) for x in err["loc"][:2]) for err in e.errors()}
    try:
        return Recipe.model_validate(_drop(dict(data), bad)), problems, broken
    except (ValidationError, TypeError, ValueError):
        return None, problems, broken
