"""Every subcommand given malformed inputs: a missing file, a directory where a file goes, a file
where a directory goes, an empty file, bytes that are not UTF-8, truncated or garbage JSON, YAML,
safetensors and GGUF, option values of the wrong type. Each is refused with exit status 2 and one
line on stderr that names the path or the value, never a traceback, before any work starts; and
what library code raises about a user's file and no command catches becomes one line too
(``plait.cli``), while plait's own bugs keep their traceback.

The commands run in this process through ``plait.cli.main``. A recipe with one problem is one
line (``plait COMMAND: field: value — fix``); several are listed under a count, one line each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from pathlib import Path

import pytest

from chat_task import chat_tokenizer
from plait.data.tasks import TASK_FILES, max_problems, write_task_files

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "default.yaml"
NXDT = ROOT / "tests" / "fixtures" / "nxdt" / "llama2_7b_sft.yaml"
UNDECODABLE = b"\xff\xfe\x00garbage"
CONTEXT = 64  # max_position_embeddings of the test model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Hugging Face directory with a ChatML tokenizer (config, model.safetensors, tokenizer)."""
    from builders import build_llama
    from plait.mesh import single_process_mesh
    from plait.models.hf_io import save_hf_checkpoint
    from plait.models.llama import LlamaConfig

    root = tmp_path_factory.mktemp("malformed")
    paths = write_task_files(root / "task", seed=0, train=20, heldout=4)
    tok = chat_tokenizer(paths["sft_train"].read_text(), 300)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      tie_word_embeddings=True, bos_token_id=None)
    mesh = single_process_mesh()
    save_hf_checkpoint(build_llama(cfg, mesh, seed=0), root / "hf", mesh.info("tp"))
    tok.save(str(root / "hf" / "tokenizer.json"))
    return root / "hf"


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Malformed inputs of every kind, in a fresh directory that is also the working directory (so
    a command that wrongly went ahead would write only there)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    f = argparse.Namespace(root=tmp_path, missing=tmp_path / "missing.yaml", folder=tmp_path / "folder",
                           file=tmp_path / "plain.bin", empty=tmp_path / "empty.jsonl",
                           undecodable=tmp_path / "undecodable.jsonl", rows=tmp_path / "rows.jsonl")
    f.folder.mkdir()
    f.file.write_bytes(b"not a directory\n")
    f.empty.write_bytes(b"")
    f.undecodable.write_bytes(UNDECODABLE + b"\n")
    f.rows.write_text('{"text": "one row"}\n')
    return f


def _copy_model(model: Path, where: Path) -> Path:
    out = where / "model"
    shutil.copytree(model, out)
    return out


def _outcome(capsys, argv: list[str]) -> tuple[int, str, str]:
    from plait.cli import main

    try:
        status = main([str(a) for a in argv])
    except SystemExit as e:  # argparse: --help, usage errors
        status = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return status, out.out, out.err


def _refusal_problem(status: int, out: str, err: str, needles) -> str | None:
    """Why this outcome is not a one-line refusal, with nothing on stdout, naming every needle
    (None when it is)."""
    if "Traceback" in out + err:
        return f"a traceback: {err[-300:]!r}"
    if status != 2:
        return f"exit status {status}, stderr {err[-300:]!r}"
    if out:  # refused before any work, so before any output
        return f"output before the refusal: {out[:300]!r}"
    lines = err.strip().splitlines()
    if len(lines) != 1:
        return f"{len(lines)} lines on stderr: {err!r}"
    missing = [str(n) for n in needles if str(n) not in lines[0]]
    if missing:
        return f"the message does not name {missing}: {lines[0]!r}"
    return None


def _refused(capsys, argv, *needles) -> str:
    """Run ``plait ARGV``: exit status 2, one line on stderr (see the module doc) naming every
    needle, no traceback. Returns the line."""
    status, out, err = _outcome(capsys, argv)
    problem = _refusal_problem(status, out, err, needles)
    assert problem is None, f"plait {' '.join(map(str, argv))}: {problem}"
    return err.strip().splitlines()[-1]


def _all_refused(capsys, cases) -> None:
    """Every ``(argv, needles)`` case is a one-line refusal; the failures are listed together."""
    failures = []
    for argv, needles in cases:
        problem = _refusal_problem(*_outcome(capsys, argv), needles)
        if problem is not None:
            failures.append(f"plait {' '.join(map(str, argv))}: {problem}")
    assert not failures, "\n".join(failures)


@pytest.fixture
def no_launch(monkeypatch):
    """plait train must refuse before it claims its outputs (its first step with effects: then it
    prepares the data and launches)."""
    def claim(*args, **kwargs):
        raise AssertionError("plait train went on to claim its outputs, prepare the data and launch")

    monkeypatch.setattr("plait.checkpoint.preflight.claim_outputs", claim)


# ------------------------------------------------------------------------- input kinds
def test_missing_files(capsys, files, model):
    m = files.missing
    _all_refused(capsys, [
        (["eval", files.root / "no-model", "--data", files.rows], [files.root / "no-model", "no such directory"]),
        (["eval", model, "--data", m], [m, "no such file"]),
        (["generate", "--hf", files.root / "no-model"], [files.root / "no-model"]),
        (["config", "validate", m], [m, "no such file"]),
        (["plan", m, "--world", "2"], [m]),
        (["launch", "slurm", m, "--nodes", "1", "--gpus-per-node", "1"], [m]),
        (["import-nxdt", m], [m]),
        (["convert", files.root / "no-checkpoint", files.root / "out"], [files.root / "no-checkpoint"]),
        (["data", "prepare", files.root / "missing.txt"], [files.root / "missing.txt"]),
    ])


def test_a_directory_where_a_file_goes(capsys, files, model, no_launch):
    d = files.folder
    _all_refused(capsys, [
        (["train", d], [d, "directory"]),
        (["config", "validate", d], [d, "directory"]),
        (["config", "show", d], [d, "directory"]),
        (["plan", d, "--world", "2"], [d, "directory"]),
        (["launch", "k8s", d, "--nodes", "1", "--gpus-per-node", "1", "--image", "x"], [d, "directory"]),
        (["eval", model, "--data", d], [d, "is a directory"]),
        (["import-nxdt", d], [d]),
        (["import-nxdt", NXDT, "-o", d], [d]),
        (["data", "prepare", files.rows, "--format", "sft", "--seq-len", "64", "--tokenizer", d], [d]),
    ])


def test_a_file_where_a_directory_goes(capsys, files, model):
    f = files.file
    _all_refused(capsys, [
        (["generate", "--hf", f], [f, "is a file"]),
        (["generate", "--run", f], [f, "is a file"]),
        (["eval", f, "--data", files.rows], [f, "is a file"]),
        (["data", "task", f], [f, "is a file"]),
        (["data", "task", f / "task"], [f / "task", f"{f} is a file"]),
        (["data", "prepare", files.rows, "--out", f / "out"], ["--out", f / "out", f"{f} is a file"]),
        (["data", "prepare", files.rows, "--cache-dir", f], ["--cache-dir", f, "is a file"]),
        (["data", "prepare", files.rows, "--format", "sft", "--seq-len", "64", "--tokenizer",
          model / "tokenizer.json", "--out", f], ["--out", f]),
        (["convert", f, files.root / "out"], [f]),
        (["import-nxdt", NXDT, "-o", f / "recipe.yaml"], [f / "recipe.yaml"]),
    ])
    assert f.read_bytes() == b"not a directory\n"


def test_empty_files(capsys, files, model):
    e = files.empty
    empty_json = files.root / "empty.json"
    empty_json.write_text("{}")
    hf = _copy_model(model, files.root)
    (hf / "config.json").write_text("")
    _all_refused(capsys, [
        (["eval", model, "--data", e], [e, "no rows to score"]),
        (["eval", model, "--data", e, "--kind", "preference"], [e, "no rows to score"]),
        (["config", "validate", e], [e, "not a recipe"]),
        (["config", "validate", empty_json], [empty_json, "not a recipe"]),
        (["plan", empty_json, "--world", "2"], [empty_json, "not a recipe"]),
        (["import-nxdt", e], [e]),
        (["data", "prepare", e], [e]),
        (["generate", "--hf", hf, "--prompt", "to"], [hf / "config.json"]),
    ])


def test_undecodable_bytes(capsys, files, model):
    u = files.undecodable
    recipe = files.root / "recipe.yaml"
    recipe.write_bytes(UNDECODABLE)
    nxdt = files.root / "nxdt.yaml"
    nxdt.write_bytes(UNDECODABLE)
    text = files.root / "docs.txt"
    text.write_bytes(b"some text\n" + UNDECODABLE)
    hf = _copy_model(model, files.root)
    (hf / "chat_template.jinja").write_bytes(UNDECODABLE)
    adapter = files.root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_bytes(UNDECODABLE)
    _all_refused(capsys, [
        (["eval", model, "--data", u], [f"{u}:1", "UTF-8"]),
        (["eval", adapter, "--data", model.parent / "task" / "sft_heldout.jsonl"],
         [adapter / "adapter_config.json", "UTF-8"]),
        (["generate", "--hf", hf, "--chat", "--prompt", "hi"], [hf / "chat_template.jinja", "UTF-8"]),
        (["data", "prepare", model.parent / "task" / "sft_train.jsonl", "--format", "sft", "--seq-len", "64",
          "--tokenizer", hf / "tokenizer.json"], [hf / "chat_template.jinja", "UTF-8"]),
        (["convert", adapter, files.root / "merged", "--merge-lora"], [adapter / "adapter_config.json", "UTF-8"]),
        (["config", "validate", recipe], [recipe, "UTF-8"]),
        (["import-nxdt", nxdt], [nxdt, "UTF-8"]),
        (["data", "prepare", text], [text, "UTF-8"]),
    ])


def test_garbage_json_yaml_and_weights(capsys, files, model):
    hf = _copy_model(model, files.root)
    (hf / "tokenizer_config.json").write_text('{"chat_template": "{{ messages')  # truncated JSON
    bad_yaml = files.root / "recipe.yaml"
    bad_yaml.write_text("model:\n  hidden_size: [64\n")
    broken = files.root / "broken-weights"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"garbage!")  # header is not JSON
    adapter = files.root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": ')
    gguf = files.root / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00trunc")  # the magic, then less than a header
    _all_refused(capsys, [
        (["generate", "--hf", hf, "--chat", "--prompt", "hi"], [hf / "tokenizer_config.json", "JSON"]),
        (["eval", adapter, "--data", model.parent / "task" / "sft_heldout.jsonl"],
         [adapter / "adapter_config.json", "JSON"]),
        (["config", "validate", bad_yaml], [bad_yaml, "YAML"]),
        (["convert", broken, files.root / "out"], [broken, "truncated or corrupt"]),
        (["eval", broken, "--data", model.parent / "task" / "sft_heldout.jsonl"], [broken, "corrupt"]),
        (["convert", gguf, files.root / "out"], [gguf, "truncated"]),
    ])


def test_option_values_of_the_wrong_type(capsys, files, model):
    _all_refused(capsys, [
        (["generate", "--hf", model, "--max-new-tokens", "many"], ["--max-new-tokens", "'many'"]),
        (["generate", "--hf", model, "--top-p", "most"], ["--top-p", "'most'"]),
        (["eval", model, "--data", files.rows, "--limit", "x"], ["--limit", "'x'"]),
        (["eval", model, "--data", model.parent / "task" / "sft_heldout.jsonl", "--max-new-tokens", "0"],
         ["--max-new-tokens", "0"]),
        (["train", "--nproc", "two"], ["--nproc", "'two'"]),
        (["config", "validate", "--nproc", "two"], ["--nproc", "'two'"]),
        (["plan", RECIPE, "--world", "eight"], ["--world", "'eight'"]),
        (["launch", "slurm", RECIPE, "--nodes", "x", "--gpus-per-node", "1"], ["--nodes", "'x'"]),
        (["data", "task", files.root / "t", "--train", "lots"], ["--train", "'lots'"]),
        (["data", "prepare", files.rows, "--val-fraction", "half"], ["--val-fraction", "'half'"]),
        (["convert", model, files.root / "out", "--dtype", "int3"], ["--dtype", "'int3'"]),
        (["nonsense"], ["'nonsense'"]),
        (["config", "show", "--nproc", 2**40], ["1099511627776 processes"]),  # the layout line only on success
    ])
    assert not (files.root / "t").exists() and not (files.root / "out").exists()


# ------------------------------------------------------------------------- recipes
def test_a_file_that_is_not_a_recipe_is_refused_as_the_recipe(capsys, files, no_launch):
    """A data file, a model's config.json, a YAML list or text, a mapping without any recipe
    section: refused naming the file and what a recipe is, before anything is prepared or launched."""
    config_json = files.root / "config.json"
    config_json.write_text(json.dumps({"vocab_size": 100, "hidden_size": 64}))
    listed = files.root / "list.yaml"
    listed.write_text("- model\n- data\n")
    nothing = files.root / "other.yaml"
    nothing.write_text("name: my run\nsteps: 10\n")
    parquet = files.root / "rows.parquet"
    parquet.write_bytes(b"PAR1\x00\x00garbage")
    cases = []
    for path in (files.rows, files.empty, files.undecodable, config_json, listed, nothing, parquet):
        for argv in (["train", path], ["config", "validate", path], ["plan", path, "--world", "2"],
                     ["launch", "slurm", path, "--nodes", "1", "--gpus-per-node", "1"]):
            cases.append((argv, [path, "not a recipe", "a recipe is a YAML file mapping sections"]))
    cases.append((["train", files.rows], ["data.source="]))  # the way to train on it
    _all_refused(capsys, cases)
    assert sorted(p.name for p in files.root.iterdir()) == sorted(
        ["folder", "plain.bin", "empty.jsonl", "undecodable.jsonl", "rows.jsonl", "config.json", "list.yaml",
         "other.yaml", "rows.parquet"])  # no run directory, no prepared data


def test_a_recipe_section_written_as_a_list_or_value(capsys, files, no_launch):
    recipe = files.root / "recipe.yaml"
    recipe.write_text("parallel: [tp, 2]\n")
    section = "a section must be a mapping of its fields"
    _all_refused(capsys, [
        (["train", recipe], ["parallel", section]),
        (["train", "parallel=[tp,2]"], ["parallel", section]),
        (["train", RECIPE, "model=5"], ["model", section]),
        (["config", "validate", recipe], ["parallel", section]),
        (["plan", recipe, "--world", "2"], ["parallel", section]),
        (["launch", "slurm", recipe, "--nodes", "1", "--gpus-per-node", "2"], ["parallel", section]),
    ])


def test_a_typo_of_a_section_is_still_named_as_such(capsys, files):
    """The not-a-recipe check leaves a mistyped section to the section check's 'did you mean'."""
    recipe = files.root / "recipe.yaml"
    recipe.write_text("modle:\n  hidden_size: 64\n")
    assert "did you mean 'model'" in _refused(capsys, ["config", "validate", recipe], "modle")


# ------------------------------------------------------------------------- generate
def test_generate_system_needs_chat(capsys, model):
    _refused(capsys, ["generate", "--hf", model, "--system", "Be brief.", "--prompt", "to be"],
             "--system needs --chat")


def test_generate_refuses_more_tokens_than_the_context_holds(capsys, model):
    err = _refused(capsys, ["generate", "--hf", model, "--prompt", "to", "--max-new-tokens", "100000"],
                   "--max-new-tokens=100000", f"max_position_embeddings={CONTEXT}", "the prompt is")
    from tokenizers import Tokenizer

    prompt = len(Tokenizer.from_file(str(model / "tokenizer.json")).encode("to").ids)
    assert f"the prompt is {prompt} tokens" in err and f"at most {CONTEXT - prompt} new tokens" in err
    _refused(capsys, ["generate", "--hf", model, "--prompt", "to " * (2 * CONTEXT)],
             "the prompt is", f"max_position_embeddings={CONTEXT}")
    status, out, err = _outcome(capsys, ["generate", "--hf", model, "--prompt", "to", "--greedy"])
    assert status == 0 and err == "" and out.startswith("to")  # the default (100) shrinks to what fits


def test_generate_with_odd_option_values(capsys, model):
    """Bytes of the command line that are not UTF-8 (Python keeps them as surrogates) and a
    temperature so small the logits overflow."""
    _refused(capsys, ["generate", "--hf", model, "--prompt", "to \udcff"], "--prompt", "not UTF-8")
    _refused(capsys, ["generate", "--hf", model, "--chat", "--prompt", "hi", "--system", "\udcff"], "--system")
    status, out, err = _outcome(capsys, ["generate", "--hf", model, "--prompt", "to", "--temperature", "1e-300",
                                         "--max-new-tokens", "3"])
    greedy = _outcome(capsys, ["generate", "--hf", model, "--prompt", "to", "--greedy", "--max-new-tokens", "3"])
    assert (status, out, err) == greedy  # the limit of a vanishing temperature: the argmax


def test_options_that_would_have_no_effect_are_refused(capsys, model):
    """Options the chosen mode ignores: silently dropping them would hide the mistake."""
    task = model.parent / "task"
    _all_refused(capsys, [
        (["generate", "--hf", model, "--greedy", "--temperature", "0.7"], ["--temperature=0.7", "--greedy"]),
        (["generate", "--hf", model, "--greedy", "--top-k", "5", "--top-p", "0.9"], ["--top-k=5", "--top-p=0.9"]),
        (["eval", model, "--data", task / "sft_heldout.jsonl", "--base", model], ["--base", "whole model"]),
        (["eval", model, "--data", task / "preference_heldout.jsonl", "--max-new-tokens", "4"],
         ["--max-new-tokens 4", "preference rows"]),
        (["plan", RECIPE, "--world", "4", "--rank", "3"], ["--rank 3", "--dry-run"]),
        (["plan", RECIPE, "--world", "4", "--dry-run", "--rank", "9"], ["--rank 9", "0..3"]),
        (["import-nxdt", NXDT, "--force"], ["--force", "-o"]),
        (["data", "prepare", task / "sft_train.jsonl", "--seq-len", "64", "--no-packing"],
         ["--seq-len, --no-packing", "--format sft"]),
        (["data", "prepare", task / "sft_train.jsonl", "--format", "sft", "--seq-len", "64", "--tokenizer",
          model / "tokenizer.json", "--limit", "5"], ["--limit", "--format text"]),
    ])


def test_plan_work_is_bounded(capsys):
    _refused(capsys, ["plan", RECIPE, "--world", 2**21], "--world=2097152", "at most 1048576")
    _refused(capsys, ["plan", RECIPE, "--world", "8", "--nodes-of", 2**21], "--nodes-of=2097152")


def test_generate_with_a_broken_chat_template(capsys, model, tmp_path):
    hf = _copy_model(model, tmp_path)
    argv = ["generate", "--hf", hf, "--chat", "--prompt", "What is 2 + 2?", "--max-new-tokens", "2"]
    (hf / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    _refused(capsys, argv, hf / "chat_template.jinja", "cannot be compiled")
    (hf / "chat_template.jinja").write_text("{{ messages[0].content | no_such_filter }}")
    _refused(capsys, argv, hf / "chat_template.jinja")
    (hf / "chat_template.jinja").unlink()
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": 42}))
    _refused(capsys, argv, hf / "tokenizer_config.json")


# ------------------------------------------------------------------------- eval
def test_eval_checks_paths_and_rows_before_the_model_loads(capsys, model, tmp_path, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr("plait.heldout.load_from_hf", load)
    rows = model.parent / "task" / "sft_heldout.jsonl"
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(model, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    _refused(capsys, ["eval", no_tokenizer, "--data", rows], no_tokenizer, "tokenizer.json")
    broken_template = tmp_path / "broken-template"
    shutil.copytree(model, broken_template)
    (broken_template / "chat_template.jinja").write_text("{% if %}")
    _refused(capsys, ["eval", broken_template, "--data", rows], broken_template / "chat_template.jinja")
    bad_row = tmp_path / "rows.jsonl"
    bad_row.write_text(rows.read_text() + '{"messages": "not a list"}\n')
    _refused(capsys, ["eval", model, "--data", bad_row], f"{bad_row}:5")
    blank_first = tmp_path / "preference.jsonl"  # the kind is read from the first row, not the first line
    blank_first.write_text("\n" + (model.parent / "task" / "preference_heldout.jsonl").read_text()
                           + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    _refused(capsys, ["eval", model, "--data", blank_first], f"{blank_first}:6", "chosen")


# ------------------------------------------------------------------------- data prepare
def test_data_prepare_bounds_and_huge_limits(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"Document {i}: a few words about nothing much, again and again." * 4
                                 for i in range(30)))
    _refused(capsys, ["data", "prepare", docs, "--vocab-size", 2**21, "--out", tmp_path / "big"],
             "--vocab-size 2097152", "at most 1048576")
    assert not (tmp_path / "big").exists()
    status, out, err = _outcome(capsys, ["data", "prepare", docs, "--limit", 2**80, "--vocab-size", "300",
                                         "--out", tmp_path / "all", "--no-progress"])
    assert status == 0 and "Traceback" not in err, err  # more documents than there are: all of them


# ------------------------------------------------------------------------- data task
def test_data_task_beyond_the_distinct_problems_is_refused_before_work(capsys, tmp_path):
    out = tmp_path / "task"
    most = max_problems(heldout=False)
    _refused(capsys, ["data", "task", out, "--train", most + 1], f"--train {most + 1}", str(most))
    _refused(capsys, ["data", "task", out, "--heldout", 10**9], "--heldout", str(max_problems(heldout=True)))
    _refused(capsys, ["data", "task", out, "--train", "0"], "--train 0")
    assert not out.exists()


def test_data_task_leaves_nothing_behind_when_writing_fails(capsys, tmp_path, monkeypatch):
    out = tmp_path / "new" / "task"
    real = Path.write_text
    calls = []

    def write_text(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    _refused(capsys, ["data", "task", out, "--train", "5", "--heldout", "2"], "No space left", "nothing was left")
    assert not (tmp_path / "new").exists() and len(calls) == 3
    monkeypatch.undo()
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(Path, "write_text", write_text)
    calls.clear()
    _refused(capsys, ["data", "task", out, "--train", "5", "--heldout", "2"], "No space left")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # the user's directory and file stay
    assert not set(TASK_FILES) & {p.name for p in out.iterdir()}


# ------------------------------------------------------------------------- the safety net
def _raise(exc: BaseException):
    raise exc


#: (what the command does, what its one line must say): errors about a user's file, raised where
#: no command catches them
USER_ERRORS = [
    (lambda p: _raise(struct.error("unpack requires a buffer of 8 bytes")), ["truncated or malformed", "reading"]),
    (lambda p: b"\xff".decode("utf-8"), ["not UTF-8", "reading"]),
    (lambda p: json.loads("{oops"), ["Expecting property name"]),
    (lambda p: open(p / "nope.json"), ["nope.json", "No such file"]),
    (lambda p: open(p), [" Is a directory"]),
    (lambda p: __import__("yaml").safe_load("a: [1"), ["not valid YAML", "reading"]),
    (lambda p: __import__("jinja2").Template("{% if %}"), ["chat template", "reading"]),
    (lambda p: __import__("safetensors.torch").torch.load(b"\x08" + b"\x00" * 7 + b"garbage!"),
     ["truncated or corrupt", "reading"]),
    (lambda p: _raise(__import__("plait.data.errors").data.errors.DataError(f"{p}: bad\nrow")), ["bad; row"]),
]
#: plait's bugs (and a bare ValueError from code that is not plait's): their traceback stays
BUGS = [AssertionError("an invariant"), RuntimeError("a torch kernel failed"), KeyError("x"),
        ValueError("from code outside plait")]


def test_user_errors_no_command_catches_become_one_line_and_bugs_keep_their_traceback(capsys, monkeypatch,
                                                                                       tmp_path):
    """What library code raises about a file (and plait's own ValueErrors) reaching the entry
    point: ``plait COMMAND: <message>``, exit status 2, with the command's inputs named when the
    error names no file. Anything else propagates."""
    from plait.cli import main

    argv = ["eval", tmp_path / "model-dir", "--data", tmp_path / "rows.jsonl"]
    failures = []
    for make, needles in USER_ERRORS:
        monkeypatch.setattr("plait.commands.eval.run", lambda args, make=make: make(tmp_path))
        status, out, err = _outcome(capsys, argv)
        problem = _refusal_problem(status, out, err, needles)
        if problem is None and not err.startswith("plait eval: "):
            problem = f"not prefixed with the command: {err!r}"
        if problem is None and "reading" in needles and str(tmp_path / "model-dir") not in err:
            problem = f"the command's inputs are not named: {err!r}"
        if problem is not None:
            failures.append(f"{needles}: {problem}")
    assert not failures, "\n".join(failures)
    for error in BUGS:
        monkeypatch.setattr("plait.commands.eval.run", lambda args, error=error: _raise(error))
        with pytest.raises(type(error)):
            main([str(a) for a in argv])


def test_usage_errors_are_one_line_and_help_still_works(capsys):
    _refused(capsys, ["generate"], "plait generate", "--run", "--hf", "--help")
    _refused(capsys, ["eval", "model", "--data", "x", "--bogus"], "--bogus")
    _refused(capsys, [], "plait", "COMMAND")
    status, out, _ = _outcome(capsys, ["data", "task", "--help"])
    assert status == 0 and "--train" in out
