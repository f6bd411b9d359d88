"""GRPO's recipe section, its rules and its prepared prompts (single process, no model weights).

A valid GRPO recipe validates; each input GRPO cannot use is refused before launch as one problem
naming its field (a reward that does not load among them); prompt rows are read and checked, then
prepared into a keyed directory that is reused, refuses a prompt with no room for its completion,
splits train and validation disjointly, reads back as it was written, and never replaces a
directory plait did not write.
"""

from __future__ import annotations

import json
import typing

import pytest

from chat_task import task_with_tokenizer
from plait.config import RecipeError, check_recipe, load_recipe
from plait.config.rules.checker import Checker
from plait.config.rules.grpo import check_grpo
from plait.config.schema import GrpoSection
from plait.data.chat_template import load_chat_template
from plait.data.errors import DataError
from plait.data.prompt_prepare import (
    PROMPTS_FORMAT,
    PromptDataset,
    prepare_prompts,
    prompts_directory,
    read_prompt_rows,
)
from plait.data.tokenizer import load_tokenizer_file
from plait.post_training.grpo_loss import VARIANTS
from plait.train.entry import prepare_data


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_with_tokenizer(tmp_path_factory.mktemp("grpo"), seed=2, train=40, heldout=6)


def _grpo(task, *extra: str) -> list[str]:
    root, paths = task
    return ["train.objective=grpo", "data.format=prompts", f"data.source={paths['prompts_train']}",
            f"data.tokenizer={root / 'tokenizer.json'}", f"data.cache_dir={root / 'cache'}", *extra]


def _problems(items: list[str]) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        check_recipe(None, items, world_size=None)
    return info.value


# ---------------------------------------------------------------------------------- the section
def test_a_grpo_recipe_validates(task):
    resolved = check_recipe(None, _grpo(task, "grpo.group_size=4", "grpo.loss=dapo", "grpo.epsilon_high=0.28",
                                        "grpo.kl_coef=0.05", "grpo.reward=regex",
                                        "grpo.reward_pattern=(The answer is )?{answer}",
                                        f"grpo.eval_source={task[1]['prompts_heldout']}"), world_size=None)
    g = resolved.recipe.grpo
    assert (g.group_size, g.loss, g.epsilon_high, g.reward) == (4, "dapo", 0.28, "regex")
    assert g.reference_mode(None) == "frozen" and g.reference_mode(4) == "adapters_off"


def test_a_user_reward_and_pipeline_parallelism_are_accepted(task, tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(completion, row):\n    return float(completion.strip() == row['answer'])\n")
    check_recipe(None, _grpo(task, f"grpo.reward={reward}:score"), world_size=None)
    # the decoding engine serves pipeline stages: the GRPO rule refuses cp > 1, never pp > 1
    recipe = load_recipe(None, _grpo(task, "parallel.pp=2", "parallel.microbatches=2"))
    checker = Checker(recipe, set())
    check_grpo(checker)
    assert checker.problems == []


def test_defaults_and_reference_mode():
    g = GrpoSection()
    assert (g.group_size, g.max_new_tokens, g.epochs, g.loss, g.kl_coef, g.reward) == (8, 32, 1, "grpo", 0.0,
                                                                                       "exact_match")
    assert g.reference_mode(None) is None and g.reference_mode(4) is None  # no KL term: no reference
    assert GrpoSection(kl_coef=0.1, reference="frozen").reference_mode(4) == "frozen"
    assert typing.get_args(GrpoSection.model_fields["loss"].annotation) == VARIANTS


REFUSED = {
    "objective without prompts": (["train.objective=grpo"], "train.objective"),
    "grpo key with another objective": (["grpo.group_size=4"], "grpo.group_size"),
    "group splits a micro-batch": (["GRPO", "grpo.group_size=3"], "grpo.group_size"),
    "context parallel": (["GRPO", "parallel.cp=2"], "parallel.cp"),
    "eval batches are not grpo's": (["GRPO", "train.eval_batches=3"], "train.eval_batches"),
    "nothing to prefetch": (["GRPO", "data.prefetch=4"], "data.prefetch"),
    "expert parallel": (["GRPO", "model.family=mixtral", "model.num_local_experts=4", "parallel.ep=2",
                         "parallel.dp=2"], "parallel.ep"),
    "no room for the completion": (["GRPO", "grpo.max_new_tokens=128"], "grpo.max_new_tokens"),
    "unknown reward": (["GRPO", "grpo.reward=exact"], "grpo.reward"),
    "missing reward file": (["GRPO", "grpo.reward=no_such_file.py:score"], "grpo.reward"),
    "pattern without regex": (["GRPO", "grpo.reward_pattern={answer}"], "grpo.reward_pattern"),
    "regex without pattern": (["GRPO", "grpo.reward=regex"], "grpo.reward_pattern"),
    "pattern that does not compile": (["GRPO", "grpo.reward=regex", "grpo.reward_pattern=(x"],
                                      "grpo.reward_pattern"),
    "reference without KL": (["GRPO", "grpo.reference=frozen"], "grpo.reference"),
    "adapters off without LoRA": (["GRPO", "grpo.kl_coef=0.1", "grpo.reference=adapters_off"], "grpo.reference"),
    "a trained BPE": (["GRPO", "data.tokenizer=bpe"], "data.tokenizer"),
    "eval source missing": (["GRPO", "grpo.eval_source=ROOT/none.jsonl"], "grpo.eval_source"),
    "eval source not jsonl": (["GRPO", "grpo.eval_source=ROOT/tokenizer.json"], "grpo.eval_source"),
    "val_fraction with eval source": (["GRPO", "grpo.eval_source=HELDOUT", "data.val_fraction=0.2"],
                                      "data.val_fraction"),
    "source not jsonl": (["GRPO", "data.source=ROOT/tokenizer.json"], "data.source"),
    "packing with prompts": (["GRPO", "data.packing=false"], "data.packing"),
    "prompts with another objective": (["GRPO", "train.objective=sft"], "train.objective"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_refused_input_is_one_problem_naming_its_field(task, case):
    root, paths = task
    items, field = REFUSED[case]
    expanded: list[str] = []
    for item in items:
        if item == "GRPO":
            expanded += _grpo(task)
        else:
            expanded.append(item.replace("ROOT", str(root)).replace("HELDOUT", str(paths["prompts_heldout"])))
    error = _problems(expanded)
    assert error.fields == [field], str(error)


def test_a_reward_file_that_fails_to_import_is_a_problem_naming_grpo_reward(task, tmp_path):
    reward = tmp_path / "broken_reward.py"
    reward.write_text("import no_such_module_here\n\ndef score(completion, row):\n    return 1.0\n")
    error = _problems(_grpo(task, f"grpo.reward={reward}:score"))
    assert error.fields == ["grpo.reward"]
    assert "ModuleNotFoundError" in str(error) and "\n" not in str(error)
    reward.write_text("def score(completion):\n    return 1.0\n")  # imports, but the signature is wrong
    assert _problems(_grpo(task, f"grpo.reward={reward}:score")).fields == ["grpo.reward"]


def test_every_problem_is_reported_at_once(task):
    error = _problems(_grpo(task, "grpo.group_size=3", "parallel.cp=2", "grpo.reference=frozen", "grpo.reward=x"))
    assert sorted(error.fields) == ["grpo.group_size", "grpo.reference", "grpo.reward", "parallel.cp"]


# ---------------------------------------------------------------------------------- the rows
BAD_ROWS = {
    '{"prompt": "2+2?"}': "'answer'",
    '{"prompt": "2+2?", "messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}': "'messages'",
    '{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "answer": "4"}':
        "'messages[1].role'",
    '{"prompt": "2+2?", "answer": true}': "'answer'",
    '{"prompt": "", "answer": "4"}': "'prompt'",
    '{"answer": "4"}': "'prompt'",
    '["2+2?", "4"]': "JSON list",
}


@pytest.mark.parametrize("line", list(BAD_ROWS))
def test_a_malformed_prompt_row_names_file_line_and_field(tmp_path, line):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": 2}\n\n' + line + "\n")
    with pytest.raises(DataError) as info:
        read_prompt_rows(path)
    assert f"{path}:3: " in str(info.value) and BAD_ROWS[line] in str(info.value), str(info.value)


def test_rows_keep_their_fields_and_the_answer_as_text(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": 2, "level": "easy"}\n'
                    '{"messages": [{"role": "user", "content": "3+4?"}], "answer": "7"}\n')
    raw, chat = read_prompt_rows(path)
    assert raw.prompt == "1+1?" and raw.conversation is None and raw.row == {"prompt": "1+1?", "answer": "2",
                                                                              "level": "easy"}
    assert chat.prompt is None and chat.conversation is not None and chat.answer == "7"


# ---------------------------------------------------------------------------------- prepared prompts
def _prepare(task, tmp_path, **kw):
    root, paths = task
    args = {"seq_len": 128, "max_new_tokens": 16, "val_fraction": 0.25, "seed": 0, "cache_dir": tmp_path, **kw}
    return prepare_prompts(paths["prompts_train"], root / "tokenizer.json", **args)


def test_prepared_prompts_read_back_and_are_reused(task, tmp_path):
    root, paths = task
    out = _prepare(task, tmp_path)
    index = json.loads((out / "index.json").read_text())
    assert (index["format"], index["kind"], index["seq_len"], index["max_new_tokens"]) == (PROMPTS_FORMAT, "prompts",
                                                                                           128, 16)
    assert index["rows"] == {"train": 30, "val": 10} and len(index["tokenizer_sha256"]) == 64
    assert (out / "tokenizer.json").is_file() and prompts_directory(out) == out
    written = (out / "index.json").stat().st_mtime_ns, (out / "train.jsonl").stat().st_mtime_ns
    assert _prepare(task, tmp_path) == out  # same inputs: the same directory, not written again
    assert ((out / "index.json").stat().st_mtime_ns, (out / "train.jsonl").stat().st_mtime_ns) == written
    assert _prepare(task, tmp_path, max_new_tokens=8) != out  # another setting: another key

    train, val = PromptDataset(out, "train"), PromptDataset(out, "val")
    source = [json.loads(line) for line in paths["prompts_train"].read_text().splitlines()]
    seen = [train.row(i) for i in range(len(train))] + [val.row(i) for i in range(len(val))]
    assert sorted(json.dumps(r, sort_keys=True) for r in seen) == sorted(json.dumps(r, sort_keys=True)
                                                                         for r in source)  # disjoint, complete
    tokenizer = load_tokenizer_file(root / "tokenizer.json")
    template = load_chat_template(root / "tokenizer.json", tokenizer)
    text = template.render(val.row(0)["messages"], add_generation_prompt=True)
    assert val.ids(0) == tokenizer.encode(text, add_special_tokens=False).ids
    assert text.endswith("<|im_start|>assistant\n")
    assert (train.vocab_size, train.seq_len, train.eos_id) == (tokenizer.get_vocab_size(), 128,
                                                               tokenizer.token_to_id("<|endoftext|>"))
    assert train.tokenizer().to_str() == tokenizer.to_str()


def test_eval_source_is_the_validation_split(task, tmp_path):
    _, paths = task
    out = _prepare(task, tmp_path, eval_source=paths["prompts_heldout"])
    train, val = PromptDataset(out, "train"), PromptDataset(out, "val")
    assert (len(train), len(val)) == (40, 6)
    held = [json.loads(line) for line in paths["prompts_heldout"].read_text().splitlines()]
    assert [val.row(i) for i in range(len(val))] == held


def test_a_prompt_without_room_for_its_completion_is_refused(task, tmp_path):
    root, paths = task
    longest = max(len(PromptDataset(_prepare(task, tmp_path), s).ids(i)) for s in ("train", "val")
                  for i in range(len(PromptDataset(_prepare(task, tmp_path), s))))
    with pytest.raises(DataError) as info:
        _prepare(task, tmp_path, seq_len=longest + 15, max_new_tokens=16)
    message = str(info.value)
    assert f"{paths['prompts_train']}:" in message and f"is {longest} tokens" in message
    assert "grpo.max_new_tokens=16" in message and f"data.seq_len={longest + 15}" in message


def test_a_foreign_directory_is_never_replaced(task, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="does not replace what it did not write"):
        _prepare(task, tmp_path, out_dir=foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _prepare(task, tmp_path, out_dir=empty) == empty and prompts_directory(empty) == empty


# ---------------------------------------------------------------------------------- plait train's data step
def test_prepare_data_prepares_and_accepts_a_prepared_directory(task, capsys):
    recipe = check_recipe(None, _grpo(task, "data.seq_len=96"), world_size=None).recipe
    out = prepare_data(recipe, progress=True)
    assert prompts_directory(out) == out and "prompts" in capsys.readouterr().out
    again = check_recipe(None, _grpo(task, f"data.source={out}", "data.seq_len=96"), world_size=None).recipe
    assert prepare_data(again) == out
    longest = max(json.loads((out / "index.json").read_text())["longest_prompt"].values())
    too_short = (longest + 31) // 2 * 2  # even: the host-memory estimate wants an even seq_len
    short = check_recipe(None, _grpo(task, f"data.source={out}", f"data.seq_len={too_short}"),
                         world_size=None).recipe
    with pytest.raises(DataError, match="grpo.max_new_tokens=32"):
        prepare_data(short)
    error = _problems(_grpo(task, f"data.source={out}", "data.seq_len=96", "data.val_fraction=0.3"))
    assert error.fields == ["data.val_fraction"] and "already prepared" in str(error)


def test_the_shipped_grpo_recipe_validates_and_its_reward_ranks_near_misses(tmp_path, monkeypatch):
    """recipes/smollm2-135m-grpo.yaml as its header says to run it: from a directory holding the
    task files and the recipes (its reward file is a path relative to there)."""
    from pathlib import Path

    from plait.data.tasks import write_task_files
    from plait.post_training.rewards import load_reward

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    write_task_files(tmp_path / "task")
    (tmp_path / "recipes").symlink_to(recipes)
    monkeypatch.chdir(tmp_path)
    resolved = check_recipe("recipes/smollm2-135m-grpo.yaml", world_size=2)
    grpo = resolved.recipe.grpo
    assert resolved.recipe.train.objective == "grpo" and resolved.global_batch_size % grpo.group_size == 0
    reward = load_reward(grpo.reward)
    row = {"answer": "36", "messages": []}
    assert [reward(text, row) for text in (" 36\n", "18 * 2 = 36.", "360", "7", "no idea")] == [1.0, 0.3, 0.0, 0.0, 0.0]
