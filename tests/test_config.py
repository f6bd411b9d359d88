"""Recipes: schema defaults, overrides, every validation rule, derived values, YAML round trip, CLI.

Everything here is single-process and pure Python: no process group, no data, no model weights.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from plait.config import (
    Recipe,
    RecipeError,
    check_recipe,
    load_recipe,
    load_recipe_text,
    model_flops_per_token,
    parse_override,
    recipe_to_yaml,
    validate_recipe,
)
from plait.config.load import DEFAULT_RECIPE
from plait.config.schema import SECTIONS, reference_markdown
from plait.models.llama.config import LlamaConfig

REGENERATE = 'python -c "from plait.config.schema import reference_markdown as r; print(r())"'
LINE = re.compile(r"^[\w.:/<>-]+: .+ — .+$")


def problems_of(overrides, world_size=None, path=None) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        check_recipe(path, overrides, world_size)
    message = str(info.value)
    for line in message.splitlines():
        assert LINE.match(line), f"not '<field>: <value> — <valid>': {line!r}"
    assert len(message.splitlines()) == len(info.value.problems)
    return info.value


# ---------------------------------------------------------------------- defaults and schema
def test_schema_defaults_validate():
    resolved = validate_recipe(Recipe(), None)
    r = resolved.recipe
    assert (r.run.name, r.model.hidden_size, r.parallel.tp, r.precision.preset) == ("shakespeare-tiny", 256, 1, "fp32")
    assert (resolved.world_size, resolved.dp, resolved.kv_replication) == (1, 1, 1)
    assert resolved.global_batch_size == 8 and resolved.tokens_per_step == 8 * 128
    assert resolved.output_dir == "runs/shakespeare-tiny"
    assert resolved.checkpoint_dir == "runs/shakespeare-tiny/final"
    assert resolved.warnings == ()


def test_builtin_default_recipe_is_two_process_tensor_parallel():
    """``plait train`` with no recipe: TP=2 with sequence parallelism on 2 processes."""
    resolved = validate_recipe(load_recipe(DEFAULT_RECIPE, []), 2)
    r = resolved.recipe
    assert (r.parallel.tp, r.parallel.sequence_parallel, r.data.source) == (2, True, "shakespeare")
    assert (resolved.world_size, resolved.dp) == (2, 1)
    assert resolved.warnings == ()


def test_every_field_has_a_default_type_and_description():
    for name, cls in SECTIONS.items():
        assert cls.model_config["extra"] == "forbid"
        for field, info in cls.model_fields.items():
            assert not info.is_required(), f"{name}.{field} has no default"
            assert info.description and "\n" not in info.description, f"{name}.{field} needs a one-line description"
            assert info.annotation is not None


def test_docs_field_tables_match_the_schema():
    docs = (Path(__file__).parents[1] / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert reference_markdown() in docs, "regenerate the tables: " + REGENERATE


# ---------------------------------------------------------------------- overrides and loading
def test_overrides_are_typed_and_applied_in_order():
    r = load_recipe(None, ["parallel.tp=2", "optimizer.lr=1e-3", "model.rope_scaling=null",
                           "train.sample_prompt=ROMEO:", "run.name=123", "logging.plot=false",
                           "data.cache_dir=null", "parallel.tp=4"])
    assert r.parallel.tp == 4 and isinstance(r.parallel.tp, int)
    assert r.optimizer.lr == 1e-3 and isinstance(r.optimizer.lr, float)
    assert r.model.rope_scaling is None and r.data.cache_dir is None
    assert r.train.sample_prompt == "ROMEO:" and r.run.name == "123" and r.logging.plot is False


def test_mapping_overrides_and_quoting():
    r = load_recipe(None, ["model.rope_scaling={rope_type: llama3, factor: 8.0, original_max_position_embeddings: 64}",
                           "model.rope_scaling.factor=4", "train.sample_prompt='null'"])
    assert r.model.rope_scaling == {"rope_type": "llama3", "factor": 4, "original_max_position_embeddings": 64}
    assert r.train.sample_prompt == "null"
    assert parse_override("model.hf_path=null") == (["model", "hf_path"], None)
    assert parse_override("data.source=/data/my corpus") == (["data", "source"], "/data/my corpus")


def test_recipe_file_with_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("run:\n  name: tiny\n  output_dir: out/{name}\noptimizer:\n  lr: 3e-4\nparallel:\n  tp: 2\n")
    r = load_recipe(str(path), ["parallel.tp=1"])
    assert r.optimizer.lr == 3e-4 and r.parallel.tp == 1  # '3e-4' is a float (YAML 1.2), override wins
    resolved = validate_recipe(r, 2)
    assert resolved.output_dir == "out/tiny" and resolved.dp == 2
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(RecipeError, match="empty.yaml' — not a recipe: it is empty"):  # not the defaults
        load_recipe(str(tmp_path / "empty.yaml"))


def test_yaml_round_trip():
    r = load_recipe(None, ["parallel.tp=2", "model.rope_scaling={rope_type: llama3, factor: 8.0, "
                           "original_max_position_embeddings: 64}", "optimizer.eps=1e-6"])
    assert load_recipe_text(recipe_to_yaml(r)) == r
    resolved = validate_recipe(r, 4)
    filled = load_recipe_text(recipe_to_yaml(resolved))  # derived values written in
    assert (filled.parallel.dp, filled.parallel.kv_replication, filled.data.global_batch_size) == (2, 1, 16)
    again = validate_recipe(filled, 4)
    assert (again.dp, again.global_batch_size, again.output_dir, again.checkpoint_dir) == (
        resolved.dp, resolved.global_batch_size, resolved.output_dir, resolved.checkpoint_dir)


# ---------------------------------------------------------------------- derived values
def test_derived_values():
    resolved = check_recipe(None, ["parallel.tp=2", "parallel.microbatches=2", "run.name=x"], 8)
    assert (resolved.world_size, resolved.dp) == (8, 4)
    assert resolved.global_batch_size == 8 * 2 * 4 and resolved.tokens_per_step == 64 * 128
    assert resolved.output_dir == "runs/x" and resolved.checkpoint_dir == "runs/x/final"
    assert check_recipe(None, ["parallel.tp=8"], 8).kv_replication == 2  # 4 KV heads over 8 ranks
    assert check_recipe(None, ["parallel.tp=4"]).world_size == 4  # no world size: tp*pp*(dp or 1)
    layout = check_recipe(None, ["parallel.tp=8", "parallel.kv_placement=adjacent"], 8).head_layout()
    assert (layout.tp, layout.kv_replication, layout.placement) == (8, 2, "adjacent")
    assert "dp=4" in resolved.summary_line() and "runs/x" in resolved.summary_line()


def test_validate_accepts_raw_data():
    resolved = validate_recipe({"parallel": {"tp": 2}, "data": {"micro_batch_size": 4}}, 4)
    assert (resolved.dp, resolved.global_batch_size) == (2, 8)
    with pytest.raises(RecipeError, match="parallel.tp: 'x'"):
        validate_recipe({"parallel": {"tp": "x"}}, 4)


def test_parameter_count_and_flops():
    resolved = validate_recipe(Recipe(), 1)
    config = resolved.model_config(1000)
    assert config == Recipe().model.to_model_config(1000) and config.vocab_size == 1000
    assert resolved.num_parameters(1000) == config.num_parameters()
    h, layers, heads, d, seq = 256, 4, 8, 32, 128
    embed = 1000 * h
    non_embedding = config.num_parameters() - embed  # tied: one embedding matrix
    expected = 6 * (non_embedding + embed) + 12 * layers * heads * d * seq
    assert resolved.flops_per_token(1000) == expected == model_flops_per_token(config, seq)
    numbers = resolved.model_numbers(1000)
    assert numbers.non_embedding_parameters == non_embedding
    assert numbers.flops_per_step == expected * resolved.tokens_per_step
    assert resolved.model_numbers().vocab_size == 2048  # data.vocab_size when model.vocab_size is null


def _hf_dir(tmp_path, **kw) -> Path:
    config = LlamaConfig(**{"vocab_size": 500, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
                            "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 512,
                            **kw})
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config.to_hf_dict()))
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, config.vocab_size)}}
    Tokenizer(models.WordLevel(vocab, unk_token="w1")).save(str(d / "tokenizer.json"))
    return d


def test_hf_path_architecture_comes_from_config_json(tmp_path):
    d = _hf_dir(tmp_path)
    resolved = check_recipe(None, [f"model.hf_path={d}", f"data.tokenizer={d / 'tokenizer.json'}",
                                   "data.seq_len=256", "parallel.tp=2"])
    config = resolved.model_config()
    assert (config.hidden_size, config.vocab_size, config.num_attention_heads) == (96, 500, 6)
    assert resolved.kv_replication == 1 and resolved.num_parameters() == config.num_parameters()
    assert resolved.as_recipe().model.hidden_size == 96


# ---------------------------------------------------------------------- invalid recipes
# (overrides, world size, field path that the message must name)
INVALID = [
    (["parallel.tp=two"], None, "parallel.tp"),                          # type: string for int
    (["parallel.tp=true"], None, "parallel.tp"),                         # type: bool is not an int
    (["optimizer.lr=fast"], None, "optimizer.lr"),                       # type: string for float
    (["logging.plot=2"], None, "logging.plot"),                          # type: int for bool
    (["parallel=3"], None, "parallel"),                                  # a section that is not a mapping
    (["parallel.tpp=2"], None, "parallel.tpp"),                          # unknown key (typo)
    (["paralel.tp=2"], None, "paralel"),                                 # unknown section
    (["precision.preset=fp8"], None, "precision.preset"),                # bad literal
    (["scheduler.name=step"], None, "scheduler.name"),                   # bad literal
    (["parallel.kv_placement=random"], None, "parallel.kv_placement"),   # bad literal
    (["optimizer.lr=0"], None, "optimizer.lr"),                          # lr > 0
    (["scheduler.min_lr_ratio=1.5"], None, "scheduler.min_lr_ratio"),    # min_lr_ratio in [0, 1]
    (["scheduler.min_lr_ratio=-0.1"], None, "scheduler.min_lr_ratio"),
    (["train.eval_every=0"], None, "train.eval_every"),                  # >= 1
    (["train.log_every=0"], None, "train.log_every"),                    # >= 1
    (["parallel.tp=3"], 4, "parallel.tp"),                               # world % (tp*pp)
    (["parallel.tp=2", "parallel.dp=4"], 4, "parallel.dp"),              # explicit dp != world/(tp*pp)
    (["parallel.tp=16"], 16, "parallel.tp"),                             # HeadLayout: tp > heads
    (["parallel.tp=2", "parallel.kv_replication=3"], 2, "parallel.kv_replication"),  # HeadLayout: invalid m
    (["parallel.tp=4", "parallel.kv_replication=4"], 4, "parallel.kv_replication"),  # m must divide the group
    (["parallel.tp=4", "model.intermediate_size=770"], 4, "parallel.tp"),  # intermediate_size % tp
    (["data.seq_len=512"], None, "data.seq_len"),                        # seq_len <= max_position_embeddings
    (["parallel.tp=4", "parallel.sequence_parallel=true", "data.seq_len=126"], 4, "parallel.sequence_parallel"),
    (["data.global_batch_size=10"], 2, "data.global_batch_size"),        # != micro*microbatches*dp
    (["scheduler.warmup_steps=400"], None, "scheduler.warmup_steps"),    # warmup <= steps
    (["parallel.vpp=2"], None, "parallel.vpp"),                          # vpp > 1 needs pp > 1
    (["parallel.pp=8"], 8, "model.num_hidden_layers"),                   # more stages than layers
    (["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved-1f1b", "parallel.microbatches=3"], 4,
     "parallel.microbatches"),                                             # interleaved needs m % pp == 0
    (["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=2"], 4, "parallel.schedule"),  # vpp needs interleaved
    (["precision.preset=bf16-mixed", "precision.autocast=true"], None, "precision.autocast"),  # knob of manual
    (["precision.preset=manual", "precision.grad_dtype=bf16"], None, "precision.grad_dtype"),  # fp32 weights
    (["precision.preset=manual", "precision.stochastic_rounding=true"], None, "precision.stochastic_rounding"),
    (["precision.param_dtype=fp16"], None, "precision.param_dtype"),     # bad literal
    (["train.activation_checkpointing=some"], None, "train.activation_checkpointing"),
    (["train.activation_checkpointing=selective"], None, "train.checkpoint_modules"),  # needs names
    (["train.activation_checkpointing=selective", "train.checkpoint_modules=[attn]"], None,
     "train.checkpoint_modules"),                                          # not a block submodule
    (["train.checkpoint_modules=[mlp]"], None, "train.checkpoint_modules"),  # only with selective
    (["parallel.bucket_mb=0"], None, "parallel.bucket_mb"),
    (["model.attention_dropout=1.0"], None, "model.attention_dropout"),
    (["model.num_key_value_heads=3"], None, "model.num_key_value_heads"),  # heads % kv_heads
    (["model.num_attention_heads=7", "model.num_key_value_heads=7"], None, "model.num_attention_heads"),
    (["model.head_dim=31"], None, "model.head_dim"),                     # rotary needs an even head_dim
    (["model.rope_scaling={rope_type: yarn}"], None, "model.rope_scaling"),
    (["model.rope_scaling={rope_type: llama3}"], None, "model.rope_scaling"),
    (["model.vocab_size=100"], None, "model.vocab_size"),                # smaller than the BPE
    (["data.source=/nonexistent/corpus.txt"], None, "data.source"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], None, "data.tokenizer"),
    (["model.hf_path=/nonexistent/model"], None, "model.hf_path"),
    (["run.output_dir=runs/{nmae}"], None, "run.output_dir"),
    (["checkpoint.dir={outdir}/final"], None, "checkpoint.dir"),
    (["data.vocab_size=100"], None, "data.vocab_size"),                  # below the 256 bytes + EOS
    (["data.val_fraction=1.0"], None, "data.val_fraction"),
    (["parallel.tp"], None, "override"),                                 # override without '='
]


@pytest.mark.parametrize("overrides,world,field", INVALID, ids=[" ".join(o) for o, _, _ in INVALID])
def test_invalid_recipe_names_the_field(overrides, world, field):
    error = problems_of(overrides, world)
    assert field in error.fields, f"{field} not reported: {error}"
    assert any(line.startswith(f"{field}: ") for line in str(error).splitlines())


def test_invalid_recipes_are_many_and_distinct():
    assert len({tuple(o) for o, _, _ in INVALID}) >= 22
    assert len({f for _, _, f in INVALID}) >= 22


def test_typo_suggests_the_field_and_messages_list_the_choices():
    assert "did you mean 'tp'?" in str(problems_of(["parallel.tpp=2"]))
    assert "did you mean 'parallel'?" in str(problems_of(["paralel.tp=2"]))
    assert "fewer decoder layers than pipeline stages" in str(problems_of(["parallel.pp=8"], 8))
    assert "'fp32', 'autocast', 'bf16-mixed', 'bf16-pure' or 'manual'" in str(problems_of(["precision.preset=fp8"]))
    assert "did you mean 'self_attn'?" in str(problems_of(["train.activation_checkpointing=selective",
                                                            "train.checkpoint_modules=[self_atn]"]))
    assert "the 'bf16-mixed' preset fixes it to true" in str(problems_of(["precision.preset=bf16-mixed",
                                                                            "precision.master_weights=false"]))


def test_zero1_with_one_dp_rank_is_a_warning():
    resolved = check_recipe(None, ["parallel.zero1=true", "parallel.sequence_parallel=true"], 1)
    assert [w.split(":")[0] for w in resolved.warnings] == ["parallel.sequence_parallel", "parallel.zero1"]


def test_all_problems_are_reported_together():
    error = problems_of(["parallel.microbatches=two", "optimizer.lr=-1", "data.seq_len=1024", "logign.plot=true",
                         "scheduler.warmup_steps=999", "precision.preset=bf16-pure", "precision.autocast=true"], 2)
    assert set(error.fields) == {"parallel.microbatches", "optimizer.lr", "data.seq_len", "logign",
                                 "scheduler.warmup_steps", "precision.autocast"}


def test_rules_on_broken_fields_are_skipped():
    # max_position_embeddings is unusable, so seq_len is not compared with it
    error = problems_of(["model.max_position_embeddings=big", "data.seq_len=1024"])
    assert error.fields == ["model.max_position_embeddings"]
    # a typo'd key: the rules on the field it meant are skipped (tp would be the default 1)
    error = problems_of(["parallel.tpp=3"], 4)
    assert error.fields == ["parallel.tpp"]


def test_hf_path_conflicts(tmp_path):
    d = _hf_dir(tmp_path)
    tok = f"data.tokenizer={d / 'tokenizer.json'}"
    error = problems_of([f"model.hf_path={d}", tok, "model.hidden_size=128", "model.vocab_size=500"])
    assert error.fields == ["model.hidden_size"]  # vocab_size agrees with config.json
    assert "data.tokenizer" in problems_of([f"model.hf_path={d}"]).fields  # a fresh BPE cannot fit a checkpoint
    assert "parallel.tp" in problems_of([f"model.hf_path={d}", tok, "parallel.tp=5"], 5).fields  # 192 % 5
    assert "data.seq_len" in problems_of([f"model.hf_path={d}", tok, "data.seq_len=1024"]).fields  # 512 positions
    assert "data.tokenizer" in problems_of([f"data.tokenizer={d}"]).fields  # a directory, not tokenizer.json


def test_yaml_problems(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("parallel:\n  tp: 2\n  tp: 4\n")
    error = problems_of([], path=str(dup))
    assert error.fields == ["parallel.tp"] and "twice" in str(error)
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel: [1\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(bad))
    with pytest.raises(RecipeError, match="recipe: .* no such file"):
        load_recipe(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(RecipeError, match="mapping of sections"):
        load_recipe(str(tmp_path / "list.yaml"))


def test_load_recipe_raises_on_type_errors_and_validate_on_rules():
    with pytest.raises(RecipeError, match="parallel.tp"):
        load_recipe(None, ["parallel.tp=two"])
    recipe = load_recipe(None, ["parallel.tp=3"])  # well typed; the world size is checked later
    with pytest.raises(RecipeError, match="parallel.tp"):
        validate_recipe(recipe, 4)
    with pytest.raises(RecipeError, match="world_size"):
        validate_recipe(Recipe(), 0)


def test_validation_is_pure(tmp_path, monkeypatch):
    import torch.distributed as dist

    def forbidden(*a, **k):
        raise AssertionError("validation must not start anything")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(dist, "new_group", forbidden)
    out = tmp_path / "run"
    with pytest.raises(RecipeError):
        check_recipe(None, [f"run.output_dir={out}", "parallel.tp=3", "data.seq_len=512"], 4)
    resolved = check_recipe(None, [f"run.output_dir={out}"], 1)
    assert resolved.output_dir == str(out)
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- the command
def _run_cli(argv, capsys):
    from plait.commands import config as command

    parser = argparse.ArgumentParser(prog="plait")
    command.add_parser(parser.add_subparsers(dest="command", required=True))
    code = command.run(parser.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_validate(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text("parallel:\n  tp: 2\n")
    assert _run_cli(["config", "validate", str(path), "--nproc", "4"], capsys)[:2] == (0, "ok\n")
    code, out, err = _run_cli(["config", "validate", str(path), "--nproc", "3", "parallel.pp=2"], capsys)
    assert code == 2 and out == ""
    assert "parallel.tp: 2 — " in err and "Traceback" not in err
    code, _, err = _run_cli(["config", "validate", str(path), "parallel.tpp=2"], capsys)
    assert code == 2 and "parallel.tpp: 2 — unknown field" in err
    assert _run_cli(["config", "validate"], capsys)[:2] == (0, "ok\n")  # no recipe: the built-in default
    remote = ["data.source=/cluster/corpus", "data.tokenizer=/cluster/tokenizer.json"]
    code, _, err = _run_cli(["config", "validate", str(path), *remote], capsys)
    assert code == 2 and "data.source: " in err and "data.tokenizer: " in err
    assert _run_cli(["config", "validate", str(path), *remote, "--no-path-checks"], capsys)[:2] == (0, "ok\n")


def test_cli_show(capsys):
    code, out, _ = _run_cli(["config", "show", "parallel.tp=2", "--nproc", "4"], capsys)
    assert code == 0
    for needle in ("#   dp: 2", "#   microbatches: 1", "#   tokens_per_step: 4096", "#   parameters: ",
                   "#   flops_per_token: "):
        assert needle in out
    shown = load_recipe_text(out)  # the output is itself a recipe (derived values as comments)
    assert shown.parallel.tp == 2 and shown.parallel.dp == 2
    params = load_recipe(DEFAULT_RECIPE, []).model.to_model_config(2048).num_parameters()
    assert f"#   parameters: {params} " in out
    code, _, err = _run_cli(["config", "show", "parallel.tp=3", "--nproc", "4"], capsys)
    assert code == 2 and "parallel.tp: 3" in err
