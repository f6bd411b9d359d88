"""Packaged models: ``model.hf_path: smollm2-135m-instruct`` names the model a Python package ships,
converted once into the cache; a path always wins over a name; a missing package is a recipe error
naming the field before anything starts."""

from __future__ import annotations

import json
import shutil

import pytest

from builders import build_llama
from plait.config import RecipeError, load_recipe, validate_recipe
from plait.config.load import DEFAULT_RECIPE
from plait.data.tokenizer import train_bpe
from plait.mesh import single_process_mesh
from plait.models import packaged
from plait.models.hf_io import save_hf_checkpoint
from plait.models.llama import LlamaConfig
from plait.models.packaged import PackagedModel, is_packaged_name, model_directory, packaged_model_dir
from plait.outputs.ownership import MARKER, write_marker

NAME = "smollm2-135m-instruct"


@pytest.fixture
def tiny_packaged(tmp_path, monkeypatch):
    """A packaged model ``tiny-packaged`` already converted into ``tmp_path/cache`` (a tiny Llama)."""
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "tiny-packaged",
                        PackagedModel("plait_no_such_package", "tiny.gguf", "pip install tiny"))
    tok = train_bpe(["to be or not to be, that is the question"] * 20, 300, cache_key="test-packaged")
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=None)
    out = tmp_path / "cache" / "models" / "tiny-packaged"
    save_hf_checkpoint(build_llama(cfg, single_process_mesh(), seed=0), out, single_process_mesh().info("tp"))
    tok.save(str(out / "tokenizer.json"))
    source = tmp_path / "docs.txt"
    source.write_text("to be or not to be, that is the question\n" * 50)
    return out, source


def _recipe(source) -> dict:
    return {"model": {"hf_path": "tiny-packaged"},
            "data": {"source": str(source), "tokenizer": "tiny-packaged", "seq_len": 32},
            "parallel": {"tp": 1, "sequence_parallel": False}}


def test_a_packaged_name_resolves_to_its_converted_directory_in_the_cache(tiny_packaged):
    out, source = tiny_packaged
    resolved = validate_recipe(_recipe(source), 1)
    assert resolved.recipe.model.hf_path == str(out)
    assert resolved.recipe.data.tokenizer == str(out / "tokenizer.json")
    assert resolved.hf_config is not None and resolved.hf_config.hidden_size == 32  # read from its config.json
    assert model_directory("tiny-packaged") == out


def test_an_existing_path_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_packaged_name(NAME)
    (tmp_path / NAME).mkdir()
    assert not is_packaged_name(NAME)
    assert model_directory(NAME).resolve() == (tmp_path / NAME).resolve()
    assert not is_packaged_name("models/anything")


def test_a_packaged_model_whose_package_is_missing_is_a_recipe_error(tiny_packaged):
    out, source = tiny_packaged
    shutil.rmtree(out)  # not converted yet, and its package is not installed
    with pytest.raises(RecipeError) as e:
        validate_recipe(_recipe(source), 1)
    text = str(e.value)
    assert "model.hf_path" in text and "plait_no_such_package" in text and "pip install tiny" in text, text


def test_a_foreign_directory_in_the_cache_is_not_taken_for_the_converted_model(tiny_packaged):
    """Only a directory plait wrote (its marker) counts as converted; otherwise conversion is tried
    (and here fails, naming the model, without touching the directory)."""
    out, source = tiny_packaged
    (out / MARKER).unlink()
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(RecipeError, match="model.hf_path"):
        validate_recipe(_recipe(source), 1)
    assert sorted(p.name for p in out.iterdir()) == before
    write_marker(out, "hf-model")
    assert validate_recipe(_recipe(source), 1).recipe.model.hf_path == str(out)


@pytest.mark.slow
def test_smollm2_is_converted_once_then_reused(tmp_path, monkeypatch):
    """The real packaged model: converted on first use (dequantised GGUF), read on the next."""
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    try:
        packaged.packaged_file(NAME)
    except packaged.PackagedModelError as e:
        pytest.skip(str(e))
    first = packaged_model_dir(NAME)
    config = json.loads((first / "config.json").read_text())
    assert (config["hidden_size"], config["num_key_value_heads"]) == (576, 3)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert packaged_model_dir(NAME) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    recipe = load_recipe(DEFAULT_RECIPE, [f"model.hf_path={NAME}"])
    assert recipe.model.hf_path == NAME  # parsing alone converts nothing; validation resolves


def test_a_misspelt_packaged_name_is_answered_with_the_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(packaged.PackagedModelError, match="did you mean the packaged model 'smollm2-135m-instruct'"):
        model_directory("smollm2-135m-instruc")
    assert model_directory("models/elsewhere") == tmp_path.joinpath("models/elsewhere").relative_to(tmp_path)
