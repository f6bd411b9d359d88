"""Three rules at the edges of every command, each tested as a class rather than case by case.

* Recipe keys that cannot take effect are refused before launch: every schema field that names a
  condition (``json_schema_extra={"applies": ...}``) is set, in turn, to a value other than its
  default in a recipe where its condition fails, and must be refused naming the field; the same
  values where the condition holds are accepted. Row-shaping keys against already prepared rows
  are refused unless they match what the rows were made with.
* No command writes over, around or into what it reads: ``checkpoint.dir``, ``run.output_dir``
  and ``plait convert DEST`` may not be, contain or lie inside an input (``model.hf_path``,
  ``lora.init_from``, the adapter, its base), with or without ``--overwrite``; the input is left
  byte for byte.
* A run refused before launch leaves nothing behind that was not there before.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from chat_task import base_and_adapter, chat_tokenizer
from plait.cli import main
from plait.config import RecipeError, check_recipe
from plait.config.applicability import CONDITIONS, field_condition
from plait.config.schema import Recipe
from plait.data.tasks import write_task_files
from plait.materialize import build_model
from plait.mesh import single_process_mesh
from plait.models.hf_io import save_hf_checkpoint

#: a recipe where each condition fails, and one where it holds (on top of the schema's defaults)
FAILS = {"rows": [], "sft": [], "lora": [], "quantized": ["lora.rank=4"], "bpe": ["data.tokenizer=TOKENIZER"],
         "pipeline": [],
         "context_parallel": [], "tensor_parallel": [], "zero3": [], "sharded": [],
         "final_model": ["checkpoint.save_final=false"], "sample": ["train.sample_tokens=0"],
         "text": ["data.format=sft", "train.objective=sft", "data.source=ROWS", "data.tokenizer=TOKENIZER"]}
HOLDS = {"rows": ["data.format=sft", "train.objective=sft", "data.source=ROWS", "data.tokenizer=TOKENIZER"],
         "sft": ["data.format=sft", "train.objective=sft", "data.source=ROWS", "data.tokenizer=TOKENIZER"],
         "lora": ["lora.rank=4"], "quantized": ["lora.rank=4", "lora.quantize_base=nf4"],
         "bpe": [], "pipeline": ["parallel.pp=2", "parallel.tp=1", "parallel.sequence_parallel=false",
                                 "parallel.microbatches=2"],
         "context_parallel": ["parallel.cp=2", "parallel.tp=1", "parallel.sequence_parallel=false"],
         "tensor_parallel": ["parallel.tp=2"], "final_model": [], "sample": [], "zero3": ["parallel.zero=3"],
         "sharded": ["parallel.zero=1"], "text": []}


def _tagged_fields() -> list[tuple[str, str, str]]:
    """``(section, field, condition)`` of every field of the schema that names a condition."""
    out = []
    for section_name, info in Recipe.model_fields.items():
        section = info.annotation
        if not (isinstance(section, type) and hasattr(section, "model_fields")):
            continue
        for name in section.model_fields:
            condition = field_condition(section, name)
            if condition is not None:
                out.append((section_name, name, condition))
    return out


def _other_value(section_name: str, name: str) -> str:
    """An override value of ``section.name`` other than its default, of its type."""
    section = Recipe.model_fields[section_name].annotation
    info = section.model_fields[name]
    default = info.get_default(call_default_factory=True)
    choices = [a for a in typing.get_args(info.annotation) if isinstance(a, str)]
    if choices:
        return next(c for c in choices if c != default)
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, int):
        if name == "quantize_block_size":  # an even divisor of the hidden size
            return str(default // 2)
        return str(default + (3 if name == "num_workers" else 300))
    if isinstance(default, float):
        return str(0.25 if default == 0 else default / 2 if default < 1 else default + 1.0)
    if isinstance(default, list):
        return "[q_proj]"
    if isinstance(default, str):
        return "DIRECTORY/other" if "{" in default else "other prompt"
    if default is None and name == "pipeline_cuts":
        return "[model.layers.2]"
    if default is None and name == "sources":
        return "[{source: shakespeare, weight: 1}, {source: bible, weight: 1}]"
    raise AssertionError(f"no other value for {section_name}.{name} (default {default!r})")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("apply")
    paths = write_task_files(root / "task", seed=1, train=20, heldout=2)
    chat_tokenizer(paths["sft_train"].read_text(), 300).save(str(root / "tokenizer.json"))
    return root, paths


def _fill(items: list[str], files) -> list[str]:
    root, paths = files
    return [i.replace("TOKENIZER", str(root / "tokenizer.json")).replace("ROWS", str(paths["sft_train"]))
            .replace("DIRECTORY", str(root)) for i in items]


def test_every_field_that_names_a_condition_is_covered():
    tagged = _tagged_fields()
    assert {c for _, _, c in tagged} == set(CONDITIONS), "every condition is used by a field"
    assert {"data.packing", "data.train_on_prompt", "lora.alpha", "lora.target_modules", "checkpoint.dir",
            "parallel.cp_mode", "data.vocab_size"} <= {f"{s}.{n}" for s, n, _ in tagged}


@pytest.mark.parametrize(("section", "name", "condition"), _tagged_fields(),
                         ids=[f"{s}.{n}" for s, n, _ in _tagged_fields()])
def test_a_key_that_cannot_take_effect_is_refused_and_accepted_where_it_does(files, section, name, condition):
    field = f"{section}.{name}"
    setting = f"{field}={_other_value(section, name)}"
    with pytest.raises(RecipeError) as info:
        check_recipe(None, _fill(FAILS[condition], files) + [setting], world_size=None)
    assert field in info.value.fields, str(info.value)
    message = next(str(p) for p in info.value.problems if p.field == field)
    assert "takes effect only when" in message and "remove it" in message, message
    holds = _fill(HOLDS[condition], files) + [setting]
    holds += {"target_modules": ["lora.rank=4"], "pipeline_cuts": ["parallel.partition=manual"]}.get(name, [])
    try:
        check_recipe(None, holds, world_size=None)
    except RecipeError as e:
        assert field not in e.fields, str(e)


def test_row_shaping_keys_must_match_already_prepared_rows(files, tmp_path):
    root, paths = files
    prepared = tmp_path / "rows"
    assert main(["data", "prepare", str(paths["sft_train"]), "--format", "sft", "--tokenizer",
                 str(root / "tokenizer.json"), "--out", str(prepared), "--seq-len", "256"]) == 0
    base = ["data.format=sft", "train.objective=sft", f"data.source={prepared}", "data.seq_len=256",
            f"data.tokenizer={root / 'tokenizer.json'}"]
    check_recipe(None, base + ["data.packing=true"], world_size=None)  # what the rows were made with
    for setting in ("data.packing=false", "data.train_on_prompt=true", "data.truncation=truncate_left",
                    "data.val_fraction=0.2"):
        with pytest.raises(RecipeError, match="already prepared") as info:
            check_recipe(None, base + [setting], world_size=None)
        assert setting.split("=")[0] in info.value.fields


# ---------------------------------------------------------------------------------- inputs
@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A tiny random base model and a LoRA adapter on it (names the base in its config)."""
    root = tmp_path_factory.mktemp("inputs")
    config, _ = base_and_adapter(root, chat_tokenizer("hello world " * 50, 280), max_position_embeddings=64)
    mesh = single_process_mesh()
    shallow = build_model(dataclasses.replace(config, num_hidden_layers=1), mesh, seed=1)
    save_hf_checkpoint(shallow, root / "shallow-base", mesh.info("tp"))
    return root


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("dest", ["base", "adapter", "adapter/merged", "base/merged", "."])
def test_merge_lora_never_writes_over_around_or_into_its_inputs(adapter, capsys, dest):
    before = {d: _snapshot(adapter / d) for d in ("base", "adapter")}
    target = adapter / dest
    assert main(["convert", str(adapter / "adapter"), str(target), "--merge-lora", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "which this command reads" in err and len(err.strip().splitlines()) == 1, err
    assert {d: _snapshot(adapter / d) for d in ("base", "adapter")} == before
    assert not (adapter / "adapter" / "merged").exists() and not (adapter / "base" / "merged").exists()


def test_merge_lora_into_a_new_directory_still_works(adapter, tmp_path):
    assert main(["convert", str(adapter / "adapter"), str(tmp_path / "merged"), "--merge-lora"]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()


def test_merge_into_a_base_with_fewer_layers_is_refused(adapter, tmp_path, capsys):
    status = main(["convert", str(adapter / "adapter"), str(tmp_path / "merged"), "--merge-lora", "--base",
                   str(adapter / "shallow-base")])
    assert status == 2
    err = capsys.readouterr().err
    assert "beyond the model's 1 decoder layers" in err, err
    assert not (tmp_path / "merged").exists()


def _train_items(files, out, *extra: str) -> list[str]:
    root, paths = files
    return ["data.format=sft", "train.objective=sft", f"data.source={paths['sft_train']}",
            f"data.tokenizer={root / 'tokenizer.json'}", f"run.output_dir={out}", "parallel.tp=1",
            "parallel.sequence_parallel=false", "model.hidden_size=32", "model.intermediate_size=64",
            "model.num_hidden_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=1",
            "data.seq_len=128", "model.max_position_embeddings=128", "train.steps=2", "scheduler.warmup_steps=0",
            "logging.progress_bar=false", "train.sample_tokens=0", *extra]


def test_lora_init_from_inside_the_runs_own_output_is_refused(files, adapter, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    for f in (adapter / "adapter").iterdir():
        (out / "final" / f.name).write_bytes(f.read_bytes())
    before = _snapshot(out)
    items = _train_items(files, out, "lora.rank=2", "lora.alpha=4.0", f"lora.init_from={out / 'final'}")
    assert main(["train", *items, "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert "lora.init_from" in err and "which this command reads" in err, err
    assert _snapshot(out) == before


def test_a_run_refused_for_its_data_leaves_no_directory_behind(files, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": 3}\n')
    out = tmp_path / "new" / "nested" / "run"
    items = _train_items(files, out, f"data.source={bad}", "checkpoint.save_dir=" + str(tmp_path / "ckpt" / "x"))
    assert main(["train", *items, "--nproc", "1"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and not (tmp_path / "ckpt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_a_refused_run_keeps_a_directory_that_existed(files, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": 3}\n')
    out = tmp_path / "existing"
    out.mkdir()
    assert main(["train", *_train_items(files, out, f"data.source={bad}"), "--nproc", "1"]) == 2
    capsys.readouterr()
    assert out.is_dir()


@pytest.mark.parametrize("option", [["--rdzv-endpoint", "localhost:29400"], ["--rdzv-id", "job7"],
                                    ["--rdzv-timeout", "30"]], ids=["endpoint", "id", "timeout"])
def test_rendezvous_options_without_several_hosts_are_refused(files, tmp_path, capsys, option):
    items = _train_items(files, tmp_path / "run")
    assert main(["train", *items, *option]) == 2
    err = capsys.readouterr().err
    assert option[0] in err and "needs --nnodes" in err, err
    assert not (tmp_path / "run").exists()


def test_lora_targets_the_family_does_not_have_are_refused_before_launch():
    moe = ["model.family=mixtral", "model.num_local_experts=4", "model.num_experts_per_tok=2", "lora.rank=4"]
    with pytest.raises(RecipeError) as info:
        check_recipe(None, moe + ["lora.target_modules=[q_proj,gate_proj]"], world_size=None)
    assert info.value.fields == ["lora.target_modules"]
    assert "no gate_proj projection in any decoder block" in str(info.value)
    check_recipe(None, moe + ["lora.target_modules=[q_proj,v_proj]"], world_size=None)
    check_recipe(None, ["lora.rank=4", "lora.target_modules=[gate_proj,down_proj]"], world_size=None)  # dense


def test_precompute_into_prepared_rows_that_cannot_take_the_table_is_refused_before_launch(files, tmp_path, capsys):
    root, paths = files
    prepared = tmp_path / "pairs"
    assert main(["data", "prepare", str(paths["preference_train"]), "--format", "preference", "--tokenizer",
                 str(root / "tokenizer.json"), "--out", str(prepared), "--seq-len", "256"]) == 0
    (prepared / "reference").write_text("not a directory")  # the table's place cannot be created
    capsys.readouterr()
    items = [*_train_items(files, tmp_path / "run"), "data.format=preference", "train.objective=dpo",
             f"data.source={prepared}", "data.seq_len=256", "model.max_position_embeddings=256",
             "preference.reference=precompute"]
    assert main(["train", *items, "--nproc", "1"]) == 2
    captured = capsys.readouterr()
    assert "preference.reference=precompute" in captured.err and "launching" not in captured.out, captured
    assert not (tmp_path / "run").exists()


def test_data_prepare_never_writes_into_its_source(files, tmp_path, capsys):
    root, paths = files
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 500)
    before = _snapshot(corpus)
    assert main(["data", "prepare", str(corpus), "--out", str(corpus / "prepared"), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "lies inside SOURCE" in err, err
    assert _snapshot(corpus) == before and not (corpus / "prepared").exists()
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    assert main(["data", "prepare", str(paths["sft_train"]), "--format", "sft", "--seq-len", "256",
                 "--tokenizer", str(tokenizer_dir / "tokenizer.json"), "--out", str(tokenizer_dir / "rows")]) == 0
    assert (tokenizer_dir / "rows").is_dir()  # beside a tokenizer file is not inside an input


def test_eval_refuses_more_new_tokens_than_the_context_holds(files, adapter, capsys):
    _, paths = files
    status = main(["eval", str(adapter / "adapter"), "--data", str(paths["sft_heldout"]), "--max-new-tokens", "64"])
    err = capsys.readouterr().err
    assert status == 2 and "max_position_embeddings=64" in err and "--max-new-tokens 63 or less" in err, err


def test_data_prepare_rows_take_a_tokenizer_directory_as_help_says(files, tmp_path):
    root, paths = files
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    assert main(["data", "prepare", str(paths["sft_train"]), "--format", "sft", "--seq-len", "256",
                 "--tokenizer", str(folder), "--out", str(tmp_path / "rows"), "--no-progress"]) == 0
    assert (tmp_path / "rows" / "index.json").is_file()
