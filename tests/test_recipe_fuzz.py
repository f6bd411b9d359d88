"""Property test: any recipe text, bytes or override ends in a recipe or a RecipeError, never another
exception, through the public entry points (``recipe_data`` then ``validate_recipe``).

The inputs are built from YAML's syntax characters, YAML 1.1 words, tags, anchors, the schema's
section and field names, and raw bytes, so the search reaches the parser, the value builder,
overrides and the schema. Derandomized, so every run (and CI) tries the same examples.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.config import RecipeError, validate_recipe
from plait.config.load import recipe_data
from plait.config.schema import SECTIONS

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

FIELDS = [f"{section}.{name}" for section, cls in SECTIONS.items() for name in cls.model_fields]
NAMES = list(SECTIONS) + [f.split(".")[1] for f in FIELDS]
TOKENS = (list(":-?,[]{}#&*!|>'\"%@`~.=<\\ ") + ["\n", "\n  ", "\n    ", "\t", "\r\n", "\x00", "\x85", "\ufeff",
                                                  "é", "\u2028", "---\n", "...\n", "<<", "0", "7", "2", "1e5", "3e-4",
                                                  "0o7", "0x1f", ".inf", "-.nan", "true", "off", "yes", "no", "null",
                                                  "!env", "!!python/object:os.system", "!!str", "!!int", "!!map",
                                                  "!!binary", "!!set", "&a", "*a", "%YAML 1.1\n", "%TAG ! !x\n",
                                                  "? ", "- ", ": ", "{a: 1}", "[1, 2]"] + NAMES)
#: Text made of YAML syntax, words and names: reaches far more of the grammar than random characters.
yaml_ish = st.lists(st.sampled_from(TOKENS), max_size=40).map("".join)
#: A plausible recipe skeleton with one fuzzed value per line.
shaped = st.lists(st.tuples(st.sampled_from(FIELDS), yaml_ish), max_size=6).map(
    lambda items: "".join(f"{f.split('.')[0]}:\n  {f.split('.')[1]}: {v}\n" for f, v in items))
recipe_bytes = st.one_of(yaml_ish.map(str.encode), shaped.map(str.encode), st.binary(max_size=60),
                         st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")))
override = st.one_of(st.tuples(st.sampled_from(FIELDS + ["parallel", "model.rope_scaling.factor", "a.b.c"]),
                               yaml_ish).map("=".join),
                     yaml_ish, st.text(max_size=30))


def _outcome(path: Path | None, overrides: list[str], world: int | None) -> None:
    """Load and validate; a RecipeError must hold problems, one line each."""
    try:
        validate_recipe(recipe_data(path, overrides), world)
    except RecipeError as e:
        assert e.problems, "a RecipeError without problems"
        for problem in e.problems:
            assert "\n" not in str(problem), f"a problem over several lines: {str(problem)!r}"


@FUZZ
@given(text=recipe_bytes, world=st.sampled_from([None, 1, 2, 4]))
def test_any_recipe_file_is_a_recipe_or_a_recipe_error(tmp_path_factory, text, world):
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_bytes(text)
    _outcome(path, [], world)


@FUZZ
@given(overrides=st.lists(override, max_size=4), world=st.sampled_from([None, 1, 2]))
def test_any_override_is_a_recipe_or_a_recipe_error(overrides, world):
    _outcome(None, overrides, world)


@FUZZ
@given(text=shaped, overrides=st.lists(override, max_size=2))
def test_any_recipe_with_overrides_is_a_recipe_or_a_recipe_error(tmp_path_factory, text, overrides):
    path = tmp_path_factory.getbasetemp() / "fuzz-shaped.yaml"
    path.write_text(text, encoding="utf-8")
    _outcome(path, overrides, None)
