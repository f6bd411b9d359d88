"""The fine-tuning commands as a user runs them: plait data task, plait eval, plait generate --chat,
plait convert --merge-lora, with their mistakes refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from chat_task import base_and_adapter, chat_tokenizer
from plait.data.tasks import write_task_files
from plait.lora import save_peft_adapter
from plait.materialize import load_from_hf
from plait.mesh import single_process_mesh


def plait(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random model with a ChatML tokenizer, an adapter on it, and the task files."""
    root = tmp_path_factory.mktemp("cli")
    paths = write_task_files(root / "task", seed=2, train=40, heldout=4)
    tok = chat_tokenizer(paths["sft_train"].read_text(), 300)
    _, base = base_and_adapter(root, tok, max_position_embeddings=512)
    tok.save(str(root / "adapter" / "tokenizer.json"))
    return root, paths, base


def test_task_command_writes_files_and_refuses_to_overwrite(tmp_path):
    out = plait("data", "task", str(tmp_path / "t"), "--train", "5", "--heldout", "2")
    assert out.returncode == 0, out.stderr
    assert len((tmp_path / "t" / "sft_train.jsonl").read_text().splitlines()) == 5
    again = plait("data", "task", str(tmp_path / "t"))
    assert again.returncode == 2 and "already holds sft_train.jsonl" in again.stderr


def test_eval_scores_sft_and_preference_rows_of_a_model_and_an_adapter(setup):
    root, paths, _ = setup
    sft = plait("eval", str(root / "base"), "--data", str(paths["sft_heldout"]), "--json", "--max-new-tokens", "4")
    assert sft.returncode == 0, sft.stderr
    result = json.loads(sft.stdout)
    assert result["kind"] == "sft" and result["rows"] == 4 and 0 <= result["exact_match"] <= 1
    pref = plait("eval", str(root / "adapter"), "--data", str(paths["preference_heldout"]), "--json")
    assert pref.returncode == 0, pref.stderr
    assert json.loads(pref.stdout)["kind"] == "preference"
    missing = plait("eval", str(root / "base"), "--data", str(root / "nope.jsonl"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_eval_scores_grpo_prompt_rows_as_their_sft_twins(setup):
    """The task's prompt rows are its SFT rows without the answer turn: the same prompts, so the
    same greedy answers and score; `plait eval` recognises them by their 'answer'."""
    from plait.heldout import exact_match, load_scoring_model, scoring_rows

    root, paths, _ = setup
    model, tokenizer_dir = load_scoring_model(root / "base")
    sft = exact_match(model, tokenizer_dir, scoring_rows("sft", paths["sft_heldout"]), max_new_tokens=4)
    prompts = exact_match(model, tokenizer_dir, scoring_rows("prompts", paths["prompts_heldout"]), max_new_tokens=4)
    assert prompts.examples == sft.examples and (prompts.correct, prompts.total) == (sft.correct, sft.total)
    out = plait("eval", str(root / "base"), "--data", str(paths["prompts_heldout"]), "--json", "--max-new-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kind"] == "prompts"


def test_merge_lora_equals_base_plus_adapter_and_refuses_mistakes(setup):
    root, _, adapted = setup
    out = plait("convert", str(root / "adapter"), str(root / "merged"), "--merge-lora")
    assert out.returncode == 0, out.stderr
    merged = load_from_hf(root / "merged", single_process_mesh())
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((merged(ids) - adapted(ids)).abs().max()) < 1e-5
    assert (root / "merged" / "tokenizer.json").is_file()
    again = plait("convert", str(root / "adapter"), str(root / "merged"), "--merge-lora")
    assert again.returncode == 2 and "--overwrite" in again.stderr
    not_adapter = plait("convert", str(root / "base"), str(root / "m2"), "--merge-lora")
    assert not_adapter.returncode == 2 and "holds no adapter_config.json" in not_adapter.stderr


def test_generate_chat_renders_the_template(setup):
    root, _, _ = setup
    out = plait("generate", "--hf", str(root / "base"), "--chat", "--prompt", "What is 2 + 3?", "--greedy",
                "--max-new-tokens", "3", "--no-progress")
    assert out.returncode == 0, out.stderr
    empty = plait("generate", "--hf", str(root / "base"), "--chat")
    assert empty.returncode == 2 and "--chat needs --prompt" in empty.stderr


def test_lora_init_from_must_match_the_adapter(setup):
    from plait.config import RecipeError, check_recipe

    root, _, _ = setup
    adapter = str(root / "adapter")
    check_recipe(None, ["lora.rank=2", "lora.alpha=4.0", f"lora.init_from={adapter}"])  # the adapter's settings
    with pytest.raises(RecipeError, match="was trained with rank 2"):
        check_recipe(None, ["lora.rank=8", f"lora.init_from={adapter}"])
    with pytest.raises(RecipeError, match="lora.rank is null"):
        check_recipe(None, [f"lora.init_from={adapter}"])
    with pytest.raises(RecipeError, match="not a readable PEFT adapter"):
        check_recipe(None, ["lora.rank=2", f"lora.init_from={root / 'base'}"])


def test_adapter_export_is_marked_and_never_replaces_foreign_files(setup, tmp_path):
    """A LoRA run's final adapter can be written again over itself (a rerun), never over a
    directory of someone else's files, and never half-written."""
    from plait.outputs.ownership import OutputDirError

    root, _, adapted = setup
    tp = single_process_mesh().info("tp")
    out = tmp_path / "final"
    save_peft_adapter([adapted], out, tp, str(root / "base"))
    assert (out / ".plait-output.json").is_file()
    with pytest.raises(OutputDirError, match="allow replacing it"):
        save_peft_adapter([adapted], out, tp, str(root / "base"))
    save_peft_adapter([adapted], out, tp, str(root / "base"), replace=True)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(OutputDirError):
        save_peft_adapter([adapted], foreign, tp, str(root / "base"), replace=True)
    assert (foreign / "notes.txt").read_text() == "keep" and sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_eval_of_a_run_directory_names_its_model_directory(setup, tmp_path):
    """``plait eval RUN_DIR`` (a run, not a model) is told where the run's model is."""
    import shutil

    from plait.data.errors import DataError
    from plait.heldout import load_scoring_model

    root, _, _ = setup
    run = tmp_path / "run"
    shutil.copytree(root / "base", run / "final")
    with pytest.raises(DataError, match=f"its model is {run / 'final'}"):
        load_scoring_model(run)


def test_generate_from_a_lora_adapter_applies_it_to_its_base(setup, capsys):
    from tokenizers import Tokenizer

    from plait.cli import main
    from plait.inference import generate

    root, _, adapted = setup
    assert main(["generate", "--hf", str(root / "adapter"), "--prompt", "What is", "--max-new-tokens", "6",
                 "--greedy"]) == 0
    printed = capsys.readouterr().out
    tok = Tokenizer.from_file(str(root / "adapter" / "tokenizer.json"))
    ids = torch.tensor([tok.encode("What is").ids])
    with torch.no_grad():
        expected = generate(adapted.eval(), ids, 6, greedy=True, eos_id=set())
    assert printed.rstrip("\n").startswith("What is")
    assert tok.decode(expected[0, ids.shape[1]:].tolist(), skip_special_tokens=True) in printed
