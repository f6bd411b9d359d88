"""Reading recipes: YAML 1.2 files, ``section.field=value`` overrides, and YAML output.

Recipes are read as YAML 1.2 with the core schema: the only booleans are ``true``/``false``
(``off``, ``no``, ``yes``, ``on`` are text, so ``train.activation_checkpointing: off`` means the
string ``"off"``), and ``3e-4`` is a float. ruamel.yaml parses the text; the values are built
here so that everything a recipe cannot use is a :class:`RecipeError` naming the file, line and
column rather than a crash: a key written twice in one mapping (both lines named), tags such as
``!env`` or ``!!python/object``, keys that are lists or mappings, anchors that refer to
themselves, bytes that are not UTF-8. A ``%YAML 1.1`` directive does not bring back the 1.1
booleans: a recipe means the same whatever its header says.

YAML written by plait (:func:`dump_recipe_text`, :func:`recipe_to_yaml`) quotes every string
that a YAML 1.1 or a YAML 1.2 reader would take for something else (``'off'``, ``'1e5'``,
``'09'``), so it reads back identically here and in other tools.
"""

from __future__ import annotations

import math
import re
import typing
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError as RuamelYAMLError
from ruamel.yaml.error import YAMLWarning
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from ruamel.yaml.resolver import BaseResolver
from ruamel.yaml.tag import Tag

from plait.config.parse import parse_recipe_partial
from plait.config.problems import Problem, RecipeError, Verbatim, suggest
from plait.config.schema import SECTIONS, Recipe, nested_settings

# ---------------------------------------------------------------------- YAML 1.2 core schema
_TAG = "tag:yaml.org,2002:"
#: The YAML 1.2 core schema's plain scalars that are not strings (spec 10.3.2), in resolution order.
_CORE_PATTERNS = {
    "null": r"null|Null|NULL|~|",
    "bool": r"true|True|TRUE|false|False|FALSE",
    "int": r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+",
    "float": r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
}
_CORE = {name: re.compile(rf"(?:{pattern})\Z") for name, pattern in _CORE_PATTERNS.items()}
#: Tags a recipe may write explicitly (``!!str 09``); any other tag is refused.
_KNOWN_TAGS = {_TAG + name for name in ("str", "null", "bool", "int", "float", "seq", "map")}
#: Bounds that keep a hostile or broken file from exhausting memory or the stack (a recipe is a
#: few hundred values, three levels deep).
MAX_VALUES = 100_000
MAX_DEPTH = 64


_FILE = Verbatim("(file)")


def core_tag(text: str) -> str:
    """The YAML 1.2 core-schema tag of a plain (unquoted, untagged) scalar."""
    for name, pattern in _CORE.items():
        if pattern.match(text):
            return _TAG + name
    return _TAG + "str"


class _CoreResolver(BaseResolver):
    """Resolves plain scalars by the YAML 1.2 core schema only, whatever ``%YAML`` directive the
    text carries (ruamel's own resolver switches to 1.1 booleans under ``%YAML 1.1``)."""

    def __init__(self, version: Any = None, loader: Any = None, loadumper: Any = None) -> None:
        super().__init__(loadumper if loadumper is not None else loader)

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Tag:
        if kind is ScalarNode:
            return Tag(suffix=core_tag(value) if implicit[0] else _TAG + "str")
        return Tag(suffix=_TAG + ("seq" if kind is SequenceNode else "map"))

    @property
    def processing_version(self) -> tuple[int, int]:
        return (1, 2)


class _Bad(Exception):
    """A problem at one place of a YAML text: ``(line, column)`` (1-based, or None), what is shown, why."""

    def __init__(self, where: tuple[int, int] | None, shown: Any, reason: str) -> None:
        super().__init__(reason)
        self.where, self.shown, self.reason = where, shown, reason


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _mark(node_or_mark: Any) -> tuple[int, int] | None:
    mark = getattr(node_or_mark, "start_mark", node_or_mark)
    line, column = getattr(mark, "line", None), getattr(mark, "column", None)
    return None if line is None or column is None else (line + 1, column + 1)


def _compose(text: str) -> Node | None:
    """The node tree of ``text`` (``None`` for an empty document); syntax errors raise :class:`_Bad`."""
    reader = YAML(typ="safe", pure=True)
    reader.Resolver = _CoreResolver
    try:
        with warnings.catch_warnings():  # a reused anchor is valid YAML (the later one counts): no noise
            warnings.simplefilter("ignore", YAMLWarning)
            return reader.compose(text)
    except RuamelYAMLError as e:
        position = getattr(e, "position", None)
        where = _mark(getattr(e, "problem_mark", None))
        if where is None and isinstance(position, int):
            where = (text.count("\n", 0, position) + 1, position - text.rfind("\n", 0, position))
        parts = [getattr(e, "context", None), getattr(e, "problem", None) or getattr(e, "reason", None)]
        reason = ": ".join(str(p) for p in parts if p) or str(e)
        raise _Bad(where, _FILE, f"not valid YAML: {_one_line(reason)}") from None
    except RecursionError:
        raise _Bad(None, _FILE, f"nested too deeply; a recipe needs at most {MAX_DEPTH} levels") from None


@dataclass
class _Builder:
    """Builds Python values from a node tree: YAML 1.2 core scalars, lists and string-keyed dicts.

    Repeated keys are collected (all reported together); anything else a recipe cannot hold
    raises :class:`_Bad` at once. Aliases are expanded, so ``left`` bounds the expanded size.
    """

    source: str
    duplicates: list[Problem] = field(default_factory=list)
    left: int = MAX_VALUES
    active: set[int] = field(default_factory=set)

    def build(self, node: Node, path: str = "", depth: int = 0) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _Bad(_mark(node), _FILE, f"expands to more than {MAX_VALUES} values (aliases of aliases?)")
        if depth > MAX_DEPTH:
            raise _Bad(_mark(node), _FILE, f"nested too deeply; a recipe needs at most {MAX_DEPTH} levels")
        if id(node) in self.active:
            raise _Bad(_mark(node), Verbatim(f"*{node.anchor}" if node.anchor else "(alias)"),
                       "an alias inside its own anchor; a recipe cannot hold a recursive value")
        tag = node.tag
        if tag not in _KNOWN_TAGS or (tag == _TAG + "map") != isinstance(node, MappingNode) or (
                tag == _TAG + "seq") != isinstance(node, SequenceNode):
            raise _Bad(_mark(node), Verbatim(_short(node.ctag)),
                       "tags are not supported in a recipe; write the plain value (text, number, true/false, "
                       "null, list or mapping)")
        if isinstance(node, ScalarNode):
            return _scalar(node)
        self.active.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                return [self.build(item, f"{path}.{i}" if path else str(i), depth + 1)
                        for i, item in enumerate(node.value)]
            assert isinstance(node, MappingNode), "a YAML node is a scalar, a sequence or a mapping"
            return self._mapping(node, path, depth)
        finally:
            self.active.discard(id(node))

    def _mapping(self, node: MappingNode, path: str, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = _key(key_node)
            where = f"{path}.{key}" if path else key
            value = self.build(value_node, where, depth + 1)
            line = key_node.start_mark.line + 1
            if key in lines:
                shown = _one_line(value_node.value)[:60] if isinstance(value_node, ScalarNode) else "..."
                self.duplicates.append(Problem(where, Verbatim(shown), f"written twice in {self.source} "
                                                                       f"(lines {lines[key]} and {line}); keep one"))
                continue
            lines[key] = line
            out[key] = value
        return out


def _short(tag: Any) -> str:
    try:
        text = str(tag)
    except Exception:  # noqa: BLE001 - a malformed tag URI; show it as written
        text = f"{getattr(tag, 'handle', '') or ''}{getattr(tag, 'suffix', '')}"
    if text.startswith(_TAG):
        text = "!!" + text[len(_TAG):]
    return text if len(text) <= 60 else text[:57] + "..."


def _key(node: Node) -> str:
    """A mapping key as written: plain text (``1:`` is the key ``"1"``); lists, mappings and tags are refused."""
    if not isinstance(node, ScalarNode):
        raise _Bad(_mark(node), Verbatim("? ..."), "a key must be plain text (a section or field name), "
                                                    "not a list or mapping")
    if node.tag not in _KNOWN_TAGS:
        raise _Bad(_mark(node), Verbatim(_short(node.ctag)), "tags are not supported in a recipe; "
                                                              "write the plain key")
    if not node.value.isprintable():  # a line break or control character: no field has one
        raise _Bad(_mark(node), node.value, "a key must be printable text on one line (a section or field name)")
    return node.value


def _scalar(node: ScalarNode) -> Any:
    """A scalar's value by its (resolved or explicit) core-schema tag."""
    assert node.tag is not None, "the composer resolves every scalar's tag"
    kind, text = node.tag[len(_TAG):], node.value
    if kind == "str":
        return text
    if not _CORE[kind].match(text):
        raise _Bad(_mark(node), text, f"is not a valid !!{kind}; remove the tag or fix the value")
    if kind == "null":
        return None
    if kind == "bool":
        return text.lower() == "true"
    if kind == "int":
        base = {"0o": 8, "0x": 16}.get(text[:2], 10)
        try:
            return int(text[2:] if base != 10 else text, base)
        except ValueError:  # more digits than Python converts
            raise _Bad(_mark(node), Verbatim(text[:20] + "..."), "has too many digits") from None
    lowered = text.lower()
    if lowered.endswith((".inf", ".nan")):
        return -math.inf if lowered.startswith("-") else (math.nan if "nan" in lowered else math.inf)
    return float(text)


def _yaml_value(text: str, source: str) -> Any:
    """The value of one YAML document, or :class:`_Bad` / :class:`RecipeError` (repeated keys)."""
    node = _compose(text)
    if node is None:
        return None
    builder = _Builder(source)
    value = builder.build(node)
    if builder.duplicates:
        raise RecipeError(builder.duplicates)
    return value


def parse_yaml(text: str, source: str = "<recipe>") -> Any:
    """Parse YAML 1.2 text (core schema). Syntax errors, repeated keys, tags, non-text keys and
    recursive aliases raise :class:`RecipeError` naming ``source`` and the line."""
    try:
        return _yaml_value(text, source)
    except _Bad as e:
        where = f"{source}:{e.where[0]}:{e.where[1]}" if e.where else source
        raise RecipeError([Problem(where, e.shown, e.reason)]) from None


def _as_mapping(data: Any, source: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise RecipeError([Problem(source, data, "a recipe must be a mapping of sections "
                                                 f"({', '.join(SECTIONS)})")])
    return {str(k): v for k, v in data.items()}


def _decode(raw: bytes, source: str) -> str:
    """UTF-8 text of a recipe file (a leading byte-order mark dropped); other bytes are a
    :class:`RecipeError` naming the file, the line and the byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        bad = raw[e.start:e.start + 1].hex()
        raise RecipeError([Problem(f"{source}:{line}", Verbatim(f"byte 0x{bad}"),
                                   "the file is not UTF-8 text; save it as UTF-8")]) from None


#: What every "this is not a recipe" problem says a recipe is.
RECIPE_SHAPE = ("a recipe is a YAML file mapping sections (model:, data:, train:, ...) to their fields, "
                "like recipes/default.yaml")
#: Suffixes of data, weights and archive files: such a file given where the recipe goes is refused
#: by its name, before it is read (a JSON Lines file of one row would otherwise parse as YAML).
DATA_SUFFIXES = {".jsonl": "a JSON Lines data file", ".ndjson": "a JSON Lines data file", ".txt": "a text file",
                 ".parquet": "a Parquet data file", ".arrow": "an Arrow data file", ".csv": "a CSV data file",
                 ".tsv": "a TSV data file", ".npy": "a NumPy array", ".npz": "a NumPy archive",
                 ".safetensors": "a weights file", ".gguf": "a GGUF model file", ".bin": "a binary file",
                 ".pt": "a PyTorch file", ".pth": "a PyTorch file", ".ckpt": "a checkpoint file",
                 ".jinja": "a chat template", ".gz": "a compressed file", ".zst": "a compressed file",
                 ".xz": "a compressed file", ".bz2": "a compressed file", ".zip": "an archive", ".tar": "an archive"}
_DATA_KINDS = {".jsonl", ".ndjson", ".txt", ".parquet", ".arrow", ".csv", ".tsv"}


def _not_a_recipe(path: str | Path, why: str) -> RecipeError:
    return RecipeError([Problem("recipe", str(path), f"not a recipe: {why}; {RECIPE_SHAPE}")])


def _check_recipe_name(path: Path) -> None:
    """A data, weights or archive file given as the recipe is refused by its suffix."""
    suffix = path.suffix.lower()
    if suffix in DATA_SUFFIXES:
        hint = f" (to train on it, set data.source={path} in a recipe)" if suffix in _DATA_KINDS else ""
        raise _not_a_recipe(path, f"{DATA_SUFFIXES[suffix]} ({suffix}){hint}")


def _check_recipe_keys(data: Mapping[str, Any], path: str | Path) -> None:
    """A mapping none of whose keys is a recipe section, or near one (a typo the section check
    names), is some other file: a model's config.json, a data row, an NxDT config."""
    keys = [str(k) for k in data]
    if any(k in SECTIONS or suggest(k, SECTIONS) for k in keys):
        return
    shown = ", ".join(keys[:5]) + (", ..." if len(keys) > 5 else "")
    raise _not_a_recipe(path, f"none of its keys ({shown}) is a recipe section" if keys else "an empty mapping")


def check_sections(data: Mapping[str, Any]) -> None:
    """Every recipe section present is a mapping of fields (or null): a section written as a list
    or a value (``parallel: [tp, 2]``) is a problem naming it, before anything reads its fields."""
    def problem(name: str, value: Any) -> Problem:
        kind = "list" if isinstance(value, list) else "single value"
        return Problem(name, value, f"a section must be a mapping of its fields, one 'field: value' per line "
                                    f"indented under '{name}:', not a {kind}")

    problems = [problem(name, value) for name, value in data.items()
                if name in SECTIONS and value is not None and not isinstance(value, Mapping)]
    if problems:
        raise RecipeError(problems)


def read_recipe_file(path: str | Path) -> dict[str, Any]:
    """The raw data of a recipe file. A file that is not a recipe (an empty file, a data or weights
    file by its suffix, a YAML list or text, a mapping without any recipe section) is a
    :class:`RecipeError` naming it and saying what a recipe is."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError([Problem("recipe", str(path), "no such file" if not p.exists() else
                                   f"is a directory, not a file; {RECIPE_SHAPE}" if p.is_dir() else "not a file")])
    _check_recipe_name(p)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise RecipeError([Problem("recipe", str(path), f"cannot be read: {e.strerror or e}")]) from None
    data = parse_yaml(_decode(raw, str(path)), str(path))
    if data is None:  # an empty (or comment-only) file is a mistake, not a wish for the defaults
        raise _not_a_recipe(path, "it is empty (give no recipe at all for the built-in default)")
    if not isinstance(data, Mapping):
        kind = "a list" if isinstance(data, list) else "plain text or a single value"
        raise _not_a_recipe(path, f"it holds {kind}, not a mapping of sections")
    _check_recipe_keys(data, path)
    return _as_mapping(data, str(path))


def parse_recipe_text(text: str, source: str = "<recipe>") -> dict[str, Any]:
    """The raw data of recipe YAML text (e.g. :func:`dump_recipe_text` output sent to a worker)."""
    return _as_mapping(parse_yaml(text, source), source)


def dump_recipe_text(data: Mapping[str, Any] | Any) -> str:
    """Raw recipe data (plain values, lists and mappings) as YAML text that :func:`parse_recipe_text`
    reads back equal, keys in their order; strings that a YAML 1.1 or 1.2 reader would take for
    another type are quoted."""
    return yaml.dump(data, Dumper=_RecipeDumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


class _RecipeDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, which quotes strings YAML 1.1 would misread (``'off'``), also quoting
    those the YAML 1.2 core schema would (``'1e5'``, ``'09'``, ``'0o7'``)."""


_RecipeDumper.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeDumper.yaml_implicit_resolvers.items()}
_RecipeDumper.add_implicit_resolver(_TAG + "int", _CORE["int"], list("-+0123456789"))
_RecipeDumper.add_implicit_resolver(_TAG + "float", _CORE["float"], list("-+0123456789."))


# ---------------------------------------------------------------------- overrides
def _field_type(parts: list[str]) -> tuple[bool, bool]:
    """``(is_str, nullable)`` for the schema field at ``section.field`` or at a field of a settings
    model below one (``logging.wandb.name``); ``(False, False)`` if unknown."""
    if len(parts) < 2 or parts[0] not in SECTIONS:
        return False, False
    model: type[BaseModel] | None = SECTIONS[parts[0]]
    for part in parts[1:-1]:
        outer = model.model_fields.get(part) if model is not None else None
        model = nested_settings(outer.annotation) if outer is not None else None
    info = model.model_fields.get(parts[-1]) if model is not None else None
    if info is None:
        return False, False
    annotation = info.annotation
    if typing.get_origin(annotation) in (list, dict):  # list[str] is a list, not text
        return False, False
    args = typing.get_args(annotation) or (annotation,)
    return str in args or annotation is str, type(None) in args


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"parallel.tp=2"`` -> ``(["parallel", "tp"], 2)``.

    Values are parsed as YAML 1.2 (``null``, ``true``, ``1e-3``, ``off`` is text,
    ``{rope_type: llama3, factor: 8}``), except for text fields, which take the text as written
    (``train.sample_prompt=ROMEO:``) unless it is quoted or ``null``. A value that is not valid
    YAML is an error naming the field, except for text fields, which then take it as written.
    """
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() and p.strip().isprintable() for p in parts):
        raise RecipeError([Problem("override", item, "must be section.field=value, e.g. parallel.tp=2")])
    parts = [p.strip() for p in parts]
    is_str, nullable = _field_type(parts)
    try:
        value = _yaml_value(raw, f"the override {item!r}") if raw.strip() else ""
    except (_Bad, RecipeError) as e:
        if not is_str:
            reason = e.reason if isinstance(e, _Bad) else "; ".join(p.valid for p in e.problems)
            raise RecipeError([Problem(".".join(parts), raw, f"override value: {reason}")]) from None
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
    data = apply_overrides(base, overrides)
    check_sections(data)  # an override may set a whole section (parallel=5)
    return data


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
    return parse_recipe(apply_overrides(parse_recipe_text(text), overrides))


def recipe_to_yaml(recipe: Recipe | Any, *, header: str | None = None) -> str:
    """A recipe as YAML, every field written out; loads back to an equal recipe.

    Given a :class:`~plait.config.resolve.ResolvedRecipe`, writes its recipe with the derived
    values filled in (:meth:`~plait.config.resolve.ResolvedRecipe.as_recipe`).
    """
    if not isinstance(recipe, Recipe):
        recipe = recipe.as_recipe()
    text = dump_recipe_text(recipe.model_dump(mode="json"))
    if header:
        text = "".join(f"# {line}\n" for line in header.splitlines()) + text
    return text
