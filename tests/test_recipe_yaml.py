"""Recipes are YAML 1.2 (core schema): enum values such as ``off`` are text, ``3e-4`` is a float,
only ``true``/``false`` are booleans; YAML a recipe cannot hold is a RecipeError naming the file.

The enum and boolean cases are generated from the schema, so a new field is covered without
editing this file.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from plait.config import Recipe, RecipeError, load_recipe, load_recipe_text, recipe_to_yaml, validate_recipe
from plait.config.load import dump_recipe_text, parse_override, parse_recipe_text, recipe_data
from plait.config.schema import SECTIONS


def _literals(annotation: Any) -> list[Any]:
    """Every ``Literal`` value inside a field annotation (through ``Optional``/``Annotated``)."""
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    if typing.get_origin(annotation) is dict:  # the keys of a mapping (data.fields) are not values of the field
        return []
    return [v for arg in typing.get_args(annotation) for v in _literals(arg)]


def _is_bool(annotation: Any) -> bool:
    """True for ``bool`` fields (``Bool``, ``Bool | None``), not for lists or mappings of them."""
    if annotation is bool:
        return True
    if typing.get_origin(annotation) in (list, dict):
        return False
    return any(_is_bool(arg) for arg in typing.get_args(annotation))


ENUM_CASES = [(section, name, value) for section, cls in SECTIONS.items()
              for name, info in cls.model_fields.items() for value in _literals(info.annotation)]
BOOL_FIELDS = [(section, name) for section, cls in SECTIONS.items()
               for name, info in cls.model_fields.items() if _is_bool(info.annotation)]
YAML_11_BOOLEANS = ["off", "on", "yes", "no", "y", "n", "Off", "ON", "Yes", "NO"]


def _write(tmp_path: Path, text: str | bytes, name: str = "r.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return str(path)


def test_the_generated_cases_cover_the_schema():
    assert ("train", "activation_checkpointing", "off") in ENUM_CASES
    assert ("precision", "param_dtype", "bf16") in ENUM_CASES  # inside Optional[Literal]
    assert ("logging", "plot") in BOOL_FIELDS and ("precision", "autocast") in BOOL_FIELDS
    assert ("train", "checkpoint_modules") not in BOOL_FIELDS


@pytest.mark.parametrize("section,name,value", ENUM_CASES, ids=[f"{s}.{n}={v}" for s, n, v in ENUM_CASES])
def test_every_enum_value_is_itself_in_a_file_and_as_an_override(tmp_path, section, name, value):
    listed = typing.get_origin(SECTIONS[section].model_fields[name].annotation) is list  # e.g. lora.target_modules
    text = f"[{value}]" if listed else str(value)  # written literally, unquoted
    expected = [value] if listed else value
    path = _write(tmp_path, f"{section}:\n  {name}: {text}\n")
    from_file = recipe_data(path)[section][name]
    from_override = recipe_data(None, [f"{section}.{name}={text}"])[section][name]
    assert from_file == expected and type(from_file) is type(expected)
    assert from_override == expected and type(from_override) is type(expected)
    assert getattr(getattr(load_recipe(path), section), name) == expected


@pytest.mark.parametrize("word", YAML_11_BOOLEANS)
def test_yaml_11_booleans_are_text(tmp_path, word):
    path = _write(tmp_path, f"run:\n  name: {word}\ntrain:\n  sample_prompt: {word}\n")
    recipe = load_recipe(path, [f"data.source={word}"])
    assert (recipe.run.name, recipe.train.sample_prompt, recipe.data.source) == (word, word, word)
    assert load_recipe(None, [f"run.name={word}"]).run.name == word


def test_run_name_no_stays_the_string_no(tmp_path):
    assert load_recipe(_write(tmp_path, "run:\n  name: no\n")).run.name == "no"
    assert load_recipe(None, ["run.name=no"]).run.name == "no"


@pytest.mark.parametrize("section,name", BOOL_FIELDS, ids=[f"{s}.{n}" for s, n in BOOL_FIELDS])
@pytest.mark.parametrize("word", ["yes", "off"])
def test_boolean_fields_reject_yaml_11_words(tmp_path, section, name, word):
    path = _write(tmp_path, f"{section}:\n  {name}: {word}\n")
    for data in (recipe_data(path), recipe_data(None, [f"{section}.{name}={word}"])):
        with pytest.raises(RecipeError) as info:
            validate_recipe(data, None, check_paths=False)
        assert f"{section}.{name}" in info.value.fields
        line = next(str(p) for p in info.value.problems if p.field == f"{section}.{name}")
        assert repr(word) in line and "true or false" in line, line


@pytest.mark.parametrize("word,value", [("true", True), ("false", False), ("True", True), ("FALSE", False)])
def test_boolean_fields_take_true_and_false(tmp_path, word, value):
    assert load_recipe(_write(tmp_path, f"logging:\n  plot: {word}\n")).logging.plot is value
    assert load_recipe(None, [f"logging.plot={word}"]).logging.plot is value


def test_core_schema_numbers_and_nulls():
    data = parse_recipe_text("a:\n  f: 3e-4\n  g: 1E5\n  h: .5\n  i: 0o17\n  j: 0x1f\n  k: -7\n  l: ~\n  m:\n"
                             "  n: 1_000\n  o: 2024-01-01\n  p: '3e-4'\n  q: !!str 09\n  r: -.inf\n")["a"]
    assert data == {"f": 3e-4, "g": 1e5, "h": 0.5, "i": 15, "j": 31, "k": -7, "l": None, "m": None,
                    "n": "1_000", "o": "2024-01-01", "p": "3e-4", "q": "09", "r": float("-inf")}
    assert isinstance(data["g"], float) and isinstance(data["i"], int)


def test_a_yaml_11_directive_does_not_bring_back_11_booleans():
    assert parse_recipe_text("%YAML 1.1\n---\ntrain:\n  activation_checkpointing: off\n") == {
        "train": {"activation_checkpointing": "off"}}


def test_repeated_keys_name_both_lines_and_the_file(tmp_path):
    path = _write(tmp_path, "parallel:\n  tp: 2\n  tp: 4\nrun: {name: a, name: b}\n", "dup.yaml")
    with pytest.raises(RecipeError) as info:
        recipe_data(path)
    assert info.value.fields == ["parallel.tp", "run.name"]
    assert "lines 2 and 3" in str(info.value) and "dup.yaml" in str(info.value)
    with pytest.raises(RecipeError, match="model.rope_scaling: .*written twice"):
        parse_override("model.rope_scaling={factor: 2, factor: 4}")


# ---------------------------------------------------------------------- YAML a recipe cannot hold
UNUSABLE = {
    "env tag": ("run:\n  name: !env HOME\n", ":2:9: !env — tags are not supported"),
    "python tag": ("run:\n  name: !!python/object:os.system x\n", ":2:9: !!python/object:os.system — tags"),
    "python tag on a section": ("parallel: !!python/object/apply:os.getcwd []\n", ":1:11: !!python/object/apply"),
    "set tag": ("parallel: !!set {a, b}\n", ":1:11: !!set — tags"),
    "binary tag": ("run:\n  name: !!binary aGk=\n", ":2:9: !!binary — tags"),
    "timestamp tag": ("run:\n  name: !!timestamp 2024-01-01\n", ":2:9: !!timestamp"),
    "bad explicit int": ("parallel:\n  tp: !!int two\n", ":2:7: 'two' — is not a valid !!int"),
    "complex key": ("? [parallel]\n: 1\n", ":1:3: ? ... — a key must be plain text"),
    "mapping key": ("parallel:\n  ? {tp: 1}\n  : 2\n", ":2:5: ? ... — a key must be plain text"),
    "tagged key": ("parallel:\n  !env tp: 2\n", ":2:3: !env — tags are not supported"),
    "key with a line break": ('"par\\nallel": {}\n', ":1:1: 'par\\nallel' — a key must be printable text on one line"),
    "recursive alias": ("parallel: &p\n  tp: *p\n", ":1:11: *p — an alias inside its own anchor"),
    "alias bomb": ("a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(6)), "expands to more than"),
    "deep nesting": ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    "two documents": ("run: {}\n---\nrun: {}\n",
                      ":2:1: (file) — not valid YAML: expected a single document in the stream: but found"),
    "control character": ("run:\n  name: a\x01b\n", ":2:10: (file) — not valid YAML"),
    "syntax": ("parallel: [1\n", "(file) — not valid YAML"),
    "undecodable bytes": (b"run:\n  name: caf\xe9\n", ":2: byte 0xe9 — the file is not UTF-8 text"),
    "utf-16": ("run: {}\n".encode("utf-16"), ":1: byte 0xff — the file is not UTF-8 text"),
}


@pytest.mark.parametrize("name", list(UNUSABLE))
def test_unusable_yaml_is_a_one_line_error_naming_the_file_and_line(tmp_path, name):
    text, expected = UNUSABLE[name]
    path = _write(tmp_path, text, "bad recipe.yaml")
    with pytest.raises(RecipeError) as info:
        recipe_data(path, ["parallel.tp=2"])
    message = str(info.value)
    assert message.count("\n") == 0 and message.startswith(path), message
    assert expected in message, message


def test_sections_written_as_lists_are_errors_naming_the_section(tmp_path):
    path = _write(tmp_path, "parallel:\n  - tp: 2\ntrain: [1, 2]\n")
    with pytest.raises(RecipeError) as info:
        validate_recipe(recipe_data(path), 1)
    assert info.value.fields == ["parallel", "train"]
    with pytest.raises(RecipeError, match="parallel.tp: 2 — parallel is"):
        recipe_data(path, ["parallel.tp=2"])


def test_a_bom_and_windows_line_ends_are_read(tmp_path):
    path = _write(tmp_path, "\ufeffrun:\r\n  name: x\r\nparallel:\r\n  tp: 2\r\n".encode("utf-8"))
    assert recipe_data(path) == {"run": {"name": "x"}, "parallel": {"tp": 2}}


def test_bad_override_values_name_the_field():
    with pytest.raises(RecipeError, match=r"^parallel.tp: '\[1' — override value: not valid YAML"):
        parse_override("parallel.tp=[1")
    with pytest.raises(RecipeError, match=r"^parallel.tp: '!env X' — override value: tags are not supported"):
        parse_override("parallel.tp=!env X")
    with pytest.raises(RecipeError, match=r"^override: 'run.na\\nme=x' — must be section.field=value"):
        parse_override("run.na\nme=x")
    assert parse_override("run.name=!env X") == (["run", "name"], "!env X")  # text fields take it as written
    assert parse_override("train.sample_prompt='unclosed") == (["train", "sample_prompt"], "'unclosed")


# ---------------------------------------------------------------------- writing recipes
TRICKY_TEXT = ["no", "off", "On", "yes", "y", "n", "1e5", "3e-4", "09", "0o7", "0x1f", "+.5", ".inf", "true",
               "null", "~", "", "1_000", "2024-01-01", "<<", "=", "a: b", "- x", "#", "é", "tab\there",
               "line\nbreak", "!env X", "*alias"]


@pytest.mark.parametrize("text", TRICKY_TEXT)
def test_written_recipes_read_back_identically(text):
    data = {"run": {"name": text}, "train": {"sample_prompt": text, "checkpoint_modules": [text]},
            "model": {"rope_scaling": {"rope_type": text, "factor": 2.0}}, "optimizer": {"lr": 3e-4}}
    if text.isprintable():  # keys are printable text on one line
        data["model"]["rope_scaling"][text] = text
    written = dump_recipe_text(data)
    assert parse_recipe_text(written) == data  # YAML 1.2 here
    assert yaml.safe_load(written) == data  # and YAML 1.1 readers (PyYAML) elsewhere
    recipe = Recipe.model_validate({"run": {"name": text or "x"}, "train": {"sample_prompt": text}})
    assert load_recipe_text(recipe_to_yaml(recipe)) == recipe


def test_every_enum_value_survives_the_written_recipe():
    for section, name, value in ENUM_CASES:
        data = {section: {name: value}}
        assert parse_recipe_text(dump_recipe_text(data)) == data, (section, name, value)
