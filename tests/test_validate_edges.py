"""Recipe validation at the edges: everything that can be checked before launch is, with one line
naming the field, the value and the fix (architecture mismatches, rope scaling, tokenizer and
source files, vocabulary sizes, model state against host memory), and the built-in default
recipe follows ``--nproc``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from plait.config import RecipeError, check_recipe
from plait.config.host_memory import local_state_bytes, model_state_problem, state_bytes_per_stage
from plait.config.load import DEFAULT_RECIPE
from plait.config.resolve import choose_default_layout, default_layout_for
from plait.models.errors import ModelConfigError
from plait.models.llama.config import LlamaConfig

GiB = 1024**3


def problems(overrides: list[str], world: int | None = None, path: str | None = None) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        check_recipe(path, overrides, world)
    for line in str(info.value).splitlines():  # one line per problem: "<field>: <value> — <fix>"
        assert " — " in line and "Traceback" not in line, line
    return info.value


def message(error: RecipeError, field: str) -> str:
    lines = [str(p) for p in error.problems if p.field == field]
    assert lines, f"{field} not reported: {error}"
    return "\n".join(lines)


def write_tokenizer(path: Path, size: int) -> Path:
    """A real ``tokenizer.json`` of ``size`` ids, id 0 the end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def hf_dir(tmp_path: Path, config: dict, tokens: int = 500) -> tuple[Path, Path]:
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d, write_tokenizer(d / "tokenizer.json", tokens)


def llama_dict(**changes) -> dict:
    config = LlamaConfig(vocab_size=500, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    return {**config.to_hf_dict(), **changes}


GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 500, "n_embd": 96,
        "n_layer": 2, "n_head": 6, "n_positions": 512, "n_ctx": 512}


# ---------------------------------------------------------------------- 7: architecture mismatches
def test_a_gpt2_config_json_is_refused(tmp_path):
    d, tok = hf_dir(tmp_path, GPT2)
    error = problems([f"model.hf_path={d}", f"data.tokenizer={tok}"])
    text = message(error, "model.hf_path")
    assert str(d / "config.json") in text and "'gpt2'" in text and "'llama'" in text
    with pytest.raises(ModelConfigError, match="model_type 'gpt2' is not supported"):
        LlamaConfig.from_hf_dict(GPT2)


def test_a_config_json_missing_architecture_keys_is_refused(tmp_path):
    config = {k: v for k, v in llama_dict().items() if k not in ("num_hidden_layers", "intermediate_size")}
    d, tok = hf_dir(tmp_path, config)
    text = message(problems([f"model.hf_path={d}", f"data.tokenizer={tok}"]), "model.hf_path")
    assert "intermediate_size" in text and "num_hidden_layers" in text and "config.json" in text


def test_configs_plait_writes_are_read_back():
    for config in (LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4),
                   LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, attention_bias=True, o_proj_bias=False)):  # qwen2
        assert LlamaConfig.from_hf_dict(config.to_hf_dict()).num_parameters() == config.num_parameters()


def test_rope_scaling_without_rope_type_is_refused():
    text = message(problems(["model.rope_scaling={factor: 8.0, original_max_position_embeddings: 64}"]),
                   "model.rope_scaling")
    assert "needs rope_type" in text


@pytest.mark.parametrize("scaling,needle", [
    ("{rope_type: llama3, factor: '8', original_max_position_embeddings: 64}", "factor='8'"),
    ("{rope_type: llama3, factor: 0, original_max_position_embeddings: 64}", "factor=0"),
    ("{rope_type: llama3, factor: -2.0, original_max_position_embeddings: 64}", "factor=-2.0"),
    ("{rope_type: llama3, factor: 8.0, original_max_position_embeddings: 64.5}", "original_max_position_embeddings"),
    ("{rope_type: llama3, factor: 8.0, original_max_position_embeddings: 64, low_freq_factor: 4.0}",
     "must be greater than low_freq_factor"),
    ("{rope_type: llama3, factor: 8.0, original_max_position_embeddings: 64, high_freq_factor: fast}",
     "high_freq_factor='fast'"),
    ("{rope_type: llama3, factor: 8.0, original_max_position_embeddings: 64, facter: 2}", "did you mean 'factor'"),
])
def test_rope_scaling_values_are_type_and_range_checked(scaling, needle):
    assert needle in message(problems([f"model.rope_scaling={scaling}"]), "model.rope_scaling")


@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
def test_rope_scaling_of_a_config_json_is_checked_too(tmp_path, form):
    scaling = {"rope_type": "llama3", "factor": "8", "original_max_position_embeddings": 64}
    config = llama_dict(rope_scaling=scaling)
    if form == "rope_parameters":  # newer transformers: rope_theta and the scaling in one mapping
        del config["rope_scaling"], config["rope_theta"]
        config["rope_parameters"] = {**scaling, "rope_theta": 10000.0}
    d, tok = hf_dir(tmp_path, config)
    text = message(problems([f"model.hf_path={d}", f"data.tokenizer={tok}"]), "model.hf_path")
    assert "factor='8'" in text and "config.json" in text


def test_a_valid_llama3_rope_scaling_is_accepted():
    scaling = "{rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, " \
              "original_max_position_embeddings: 64}"
    assert check_recipe(None, [f"model.rope_scaling={scaling}"]).model_config().rope_type == "llama3"


# ---------------------------------------------------------------------- 8: checked before launch
def test_a_file_that_is_not_a_tokenizer_is_refused(tmp_path):
    for name, text in (("tokenizer.json", json.dumps({"vocab": {"a": 0}})), ("vocab.txt", "a\nb\n")):
        path = tmp_path / name
        path.write_text(text)
        assert "is not a tokenizer file" in message(problems([f"data.tokenizer={path}"]), "data.tokenizer")


def test_a_tokenizer_without_end_of_text_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(path))
    assert "end-of-text" in message(problems([f"data.tokenizer={path}"]), "data.tokenizer")


@pytest.mark.parametrize("name,content", [("corpus.parquet", b"PAR1\x00\x00"), ("corpus.yaml", b"a: 1"),
                                          ("corpus", b"hello"), ("corpus.txt", b"\x00\x01\x02binary"),
                                          ("corpus.jsonl", b"\xff\xfe{\x00")])
def test_a_source_file_of_an_unsupported_type_is_refused(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    text = message(problems([f"data.source={path}"]), "data.source")
    assert ".txt" in text or "UTF-8 text" in text or "cannot be read as parquet" in text


def test_model_vocab_size_smaller_than_the_tokenizer_file_is_refused(tmp_path):
    tok = write_tokenizer(tmp_path / "tokenizer.json", 300)
    text = message(problems([f"data.tokenizer={tok}", "model.vocab_size=280"]), "model.vocab_size")
    assert "280" in text and ">= 300" in text
    assert check_recipe(None, [f"data.tokenizer={tok}", "model.vocab_size=320"]).vocab_size_hint()[0] == 320


def test_a_tokenizer_larger_than_the_checkpoint_vocabulary_is_refused(tmp_path):
    d, _ = hf_dir(tmp_path, llama_dict())
    big = write_tokenizer(tmp_path / "big.json", 600)
    assert "vocab_size=500" in message(problems([f"model.hf_path={d}", f"data.tokenizer={big}"]), "data.tokenizer")


def test_an_absurd_model_is_refused_before_launch():
    text = message(problems(["model.hidden_size=65536"], 1), "model")
    assert "physical memory" in text and "52.28B parameters" in text
    # a recipe meant for another machine is not held to this host's memory
    check_recipe(None, ["model.hidden_size=65536"], 1, check_paths=False)


def test_the_memory_threshold_counts_model_state_of_the_processes_on_this_host():
    resolved = check_recipe(None, ["parallel.tp=2"], 4)  # tp=2 dp=2, fp32
    states, precision = state_bytes_per_stage(resolved)
    params = resolved.num_parameters()
    assert precision == "fp32" and len(states) == 1
    # fp32 AdamW: parameters, gradients, two moments, 4 bytes each; tp=2 halves the matrices
    assert 16 * params / 2 <= states[0] <= 16 * params
    need = local_state_bytes(states, 4, 4)
    assert need == 4 * states[0]
    # on a CPU host the step's peak counts: the model state plus activations
    peaks, _ = state_bytes_per_stage(resolved, with_activations=True)
    assert peaks[0] > states[0]
    need = local_state_bytes(peaks, 4, 4)
    assert model_state_problem(resolved, memory=need, accelerated=False) is None
    assert model_state_problem(resolved, memory=need - 1, accelerated=False) is not None
    # two of the four processes on this host (a launched multi-host world), or one per device
    assert model_state_problem(resolved, memory=need // 2, local=2, accelerated=False) is None
    assert model_state_problem(resolved, memory=states[0], accelerated=True) is None


def test_a_micro_batch_whose_activations_cannot_fit_is_refused_before_launch():
    """The parameters fit, the activations of 100,000 sequences per micro-batch do not (it met the
    kernel's out-of-memory killer after launch before)."""
    text = message(problems(["data.micro_batch_size=100000", "data.global_batch_size=null", "parallel.tp=1",
                             "parallel.sequence_parallel=false"], 1), "model")
    assert "physical memory" in text and "micro_batch_size=100000" in text


# ---------------------------------------------------------------------- 13, 14: the built-in default
def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from plait.cli import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_config_validate_without_a_recipe_checks_the_default(capsys):
    assert _cli(["config", "validate"], capsys)[:2] == (0, "ok\n")
    code, _, err = _cli(["config", "validate", "optimizer.lr=-1"], capsys)
    assert code == 2 and "optimizer.lr: -1" in err


@pytest.mark.parametrize("nproc", range(1, 9))
def test_the_default_layout_for_n_processes_is_valid(nproc):
    layout = choose_default_layout(nproc)
    assert layout.tp * layout.dp == nproc and layout.tp in (1, 2)
    assert layout.tp == (2 if nproc % 2 == 0 else 1) and layout.sequence_parallel == (layout.tp > 1)
    resolved = check_recipe(DEFAULT_RECIPE, layout.overrides(), nproc)
    assert (resolved.tp, resolved.dp, resolved.world_size) == (layout.tp, layout.dp, nproc)
    assert not resolved.warnings


def test_the_default_layout_applies_only_to_the_builtin_recipe():
    assert default_layout_for(None, ["optimizer.lr=1e-3"], 3).tp == 1
    assert default_layout_for("mine.yaml", [], 3) is None
    assert default_layout_for(None, ["parallel.tp=2"], 3) is None
    assert default_layout_for(None, ["parallel={tp: 2}"], 3) is None
    assert default_layout_for(None, [], None) is None
    with pytest.raises(ValueError, match="--nproc"):
        choose_default_layout(0)


def test_config_validate_and_train_take_the_default_on_three_processes(tmp_path, monkeypatch, capsys):
    import plait.launch
    import plait.train.entry

    assert _cli(["config", "validate", "--nproc", "3"], capsys)[:2] == (0, "ok\n")
    launched = []
    monkeypatch.setattr(plait.launch, "launch_local", lambda fn, world, text, **kw: launched.append((world, text)))
    monkeypatch.setattr(plait.train.entry, "prepare_data", lambda recipe, progress=False: None)
    code, out, err = _cli(["train", "--nproc", "3", f"run.output_dir={tmp_path / 'run'}"], capsys)
    assert code == 0, err
    assert "tp=1 dp=3" in out
    (world, text), = launched
    sent = yaml.safe_load(text)["parallel"]
    assert world == 3 and sent["tp"] == 1 and sent["sequence_parallel"] is False
    # a user's recipe (or a parallel.* override) keeps its layout and the strict error
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("parallel:\n  tp: 2\n")
    for argv in (["train", str(recipe), "--nproc", "3"], ["train", "parallel.tp=2", "--nproc", "3"]):
        code, _, err = _cli([*argv, f"run.output_dir={tmp_path / 'never'}"], capsys)
        assert code == 2 and "parallel.tp: 2" in err
    assert len(launched) == 1 and not (tmp_path / "never").exists()
