"""The arithmetic task's prompt files (for GRPO): the SFT files' problems, without the reply, with the answer."""

from __future__ import annotations

import hashlib
import json

from plait.data.tasks import SYSTEM, TASK_FILES, write_task_files

#: sha256 prefixes of the files that were there before the prompt files (seed 1, 60 / 10 problems):
#: adding files must not change what a seed writes into the others
_PINNED = {"sft_train": "fa3b5b1f98c60ce2", "sft_heldout": "3bce171398860b8c",
           "preference_train": "94afb0d28ed62e76", "preference_heldout": "96a161e3a05d6e38"}


def _rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _answer(question: str) -> str:
    a, op, b = question.removeprefix("What is ").split("?")[0].split()
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


def test_prompt_files_hold_the_sft_problems_with_right_answers(tmp_path):
    paths = write_task_files(tmp_path, seed=1, train=60, heldout=10)
    assert {p.name for p in tmp_path.iterdir()} == set(TASK_FILES) == {p.name for p in paths.values()}
    assert {name: hashlib.sha256(paths[name].read_bytes()).hexdigest()[:16] for name in _PINNED} == _PINNED
    questions = {}
    for split, count in (("train", 60), ("heldout", 10)):
        prompts, sft = _rows(paths[f"prompts_{split}"]), _rows(paths[f"sft_{split}"])
        assert len(prompts) == count
        for prompt, conversation in zip(prompts, sft, strict=True):
            assert set(prompt) == {"messages", "answer"} and isinstance(prompt["answer"], str)
            assert prompt["messages"] == conversation["messages"][:2]  # the same problem, in the same order
            assert [m["role"] for m in prompt["messages"]] == ["system", "user"]
            assert prompt["messages"][0]["content"] == SYSTEM
            question = prompt["messages"][1]["content"]
            assert prompt["answer"] == conversation["messages"][2]["content"] == _answer(question)
        questions[split] = {p["messages"][1]["content"] for p in prompts}
    assert len(questions["train"]) == 60 and len(questions["heldout"]) == 10
    assert not questions["train"] & questions["heldout"]


def test_prompt_files_are_deterministic_for_a_seed(tmp_path):
    first = write_task_files(tmp_path / "a", seed=4, train=30, heldout=5)
    again = write_task_files(tmp_path / "b", seed=4, train=30, heldout=5)
    other = write_task_files(tmp_path / "c", seed=5, train=30, heldout=5)
    for name in ("prompts_train", "prompts_heldout"):
        assert first[name].read_bytes() == again[name].read_bytes()
    assert first["prompts_train"].read_bytes() != other["prompts_train"].read_bytes()
