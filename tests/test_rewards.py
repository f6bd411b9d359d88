"""Rewards for GRPO: the built-ins, a user's function from a file (and each way it can be wrong),
and scoring that turns a bad call into one line naming the reward and the row."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from plait.post_training.rewards import RewardError, exact_match, load_reward, regex_reward, score_completions

ROW = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 48 + 17?"}],
       "answer": "65"}


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


# ------------------------------------------------------------------------------------- built-ins
def test_exact_match_compares_the_stripped_completion_with_the_answer():
    assert exact_match("65", ROW) == 1.0 and exact_match("  65\n", ROW) == 1.0
    assert exact_match("65.", ROW) == 0.0 and exact_match("The answer is 65", ROW) == 0.0
    assert exact_match("7", {"prompt": "3 + 4", "answer": 7}) == 1.0  # a numeric answer compares as text
    assert load_reward("exact_match") is exact_match


def test_regex_reward_fullmatches_and_substitutes_the_escaped_answer():
    digits = regex_reward(r"-?\d+")
    assert digits(" 65 ", ROW) == 1.0 and digits("65 apples", ROW) == 0.0  # the whole completion must match
    formatted = load_reward("regex", pattern=r"(The answer is )?{answer}\.?")
    assert formatted("The answer is 65.", ROW) == 1.0 and formatted("65", ROW) == 1.0
    assert formatted("The answer is 66.", ROW) == 0.0
    special = {"prompt": "?", "answer": "1+1"}  # regex characters in the answer are literal
    assert formatted("1+1", special) == 1.0 and formatted("11", special) == 0.0
    with pytest.raises(RewardError, match=r"pattern '\(unclosed'") as e:
        regex_reward("(unclosed")
    _one_line_error(e)
    with pytest.raises(RewardError, match=r"pattern '\{answer\}\['"):
        load_reward("regex", pattern="{answer}[")


def test_builtin_specs_are_checked():
    with pytest.raises(RewardError, match="'regex' needs a pattern"):
        load_reward("regex")
    with pytest.raises(RewardError, match="applies only to the 'regex' reward"):
        load_reward("exact_match", pattern=r"\d+")
    with pytest.raises(RewardError, match=r"'exact' is not known; choose one of \('exact_match', 'regex'\)"):
        load_reward("exact")


# ------------------------------------------------------------------------------------ user files
GOOD = '''
from dataclasses import dataclass


@dataclass
class Scale:
    factor: float = 0.5


def length_penalty(completion, row):
    return Scale().factor if completion.strip() == row["answer"] else -len(completion) / 100


def extra_default(completion, row, bonus=1.0):
    return bonus


def varargs(*args):
    return 0.0


def one_argument(completion):
    return 0.0


def needs_keyword(completion, row, *, scale):
    return scale


WEIGHT = 3
'''


def test_a_user_function_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(GOOD)
    fn = load_reward(f"{tmp_path / 'my_reward.py'}:length_penalty")
    assert fn("65", ROW) == 0.5 and fn("1234", ROW) == -0.04
    assert load_reward(f"{tmp_path / 'my_reward.py'}:extra_default")("x", ROW) == 1.0
    assert load_reward(f"{tmp_path / 'my_reward.py'}:varargs")("x", ROW) == 0.0
    monkeypatch.chdir(tmp_path)
    again = load_reward("my_reward.py:length_penalty")  # relative to the working directory
    assert again is not fn and again.__module__ != fn.__module__  # each load is a fresh module


@pytest.mark.parametrize("make, spec, words", [
    (None, "missing.py:f", ["missing.py does not exist", "give the path of a .py file"]),
    ("dir", "folder:f", ["is a directory"]),
    ("txt", "reward.txt:f", ["reward.txt is not a .py file"]),
    ("good", "my_reward.py:nothing", ["defines no 'nothing'", "length_penalty", "fix the name"]),
    ("good", "my_reward.py:WEIGHT", ["WEIGHT in", "is not callable (of type int)"]),
    ("good", "my_reward.py:one_argument", ["one_argument(completion) cannot be called as one_argument(completion, "
                                           "row)", "def one_argument(completion: str, row: dict) -> float"]),
    ("good", "my_reward.py:needs_keyword", ["needs_keyword(completion, row, *, scale) cannot be called"]),
    ("raises", "broken.py:f", ["importing", "broken.py raised ModuleNotFoundError: No module named "
                               "'not_a_module_anywhere'", "fix the file"]),
    ("syntax", "broken.py:f", ["broken.py raised SyntaxError", "line 2"]),
    ("exits", "broken.py:f", ["broken.py raised SystemExit: 3"]),
    (None, "my_reward.py:", ["give FILE.py:FUNCTION (both parts)"]),
    (None, "my_reward.py", ["is not known", "or give FILE.py:FUNCTION"]),
])
def test_user_reward_problems_are_one_line_naming_the_spec(tmp_path, monkeypatch, make, spec, words):
    monkeypatch.chdir(tmp_path)
    if make == "dir":
        (tmp_path / "folder").mkdir()
    elif make == "txt":
        (tmp_path / "reward.txt").write_text("def f(c, r): return 1.0\n")
    elif make == "good":
        (tmp_path / "my_reward.py").write_text(GOOD)
    elif make == "raises":
        (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n\ndef f(c, r):\n    return 1.0\n")
    elif make == "syntax":
        (tmp_path / "broken.py").write_text("x = 1\ndef f(c, r)\n    return 1.0\n")
    elif make == "exits":
        (tmp_path / "broken.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(RewardError) as e:
        load_reward(spec)
    message = _one_line_error(e)
    assert f"reward {spec!r}" in message
    for word in words:
        assert word in message, message
    assert isinstance(e.value, ValueError)


# --------------------------------------------------------------------------------------- scoring
def test_scores_accept_real_numbers():
    values = iter([1, 0.5, True, np.float32(0.25), torch.tensor(0.75), torch.tensor(2, dtype=torch.int64)])
    scores = score_completions(lambda c, r: next(values), "mixed", ["a"] * 6, [ROW] * 6)
    assert scores == [1.0, 0.5, 1.0, 0.25, 0.75, 2.0] and all(type(s) is float for s in scores)
    assert score_completions(exact_match, "exact_match", ["65", "64"], [ROW, ROW]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 completions for 1 rows"):
        score_completions(exact_match, "exact_match", ["65", "64"], [ROW])


def _raises(completion, row):
    raise ZeroDivisionError("division by zero\nsecond line")


LONG = {"prompt": "Compute this carefully, please:\n" + "1 + " * 40 + "1", "answer": "41"}


@pytest.mark.parametrize("fn, words", [
    (_raises, ["raised ZeroDivisionError: division by zero second line", "fix the reward function"]),
    (lambda c, r: math.nan, ["returned nan", "return a finite float"]),
    (lambda c, r: -math.inf, ["returned -inf"]),
    (lambda c, r: None, ["returned None (of type NoneType)", "return a float"]),
    (lambda c, r: "1.0", ["returned '1.0' (of type str)"]),
    (lambda c, r: torch.ones(2), ["(of type Tensor)"]),
    (lambda c, r: [1.0], ["returned [1.0] (of type list)"]),
    (lambda c, r: 1j, ["(of type complex)"]),
])
def test_a_bad_call_is_one_line_naming_the_reward_the_row_and_the_prompt(fn, words):
    rows = [ROW, LONG]
    calls = []

    def reward(completion, row):
        calls.append(row)
        return 1.0 if len(calls) == 1 else fn(completion, row)

    with pytest.raises(RewardError) as e:
        score_completions(reward, "my_reward.py:check", ["65", "41"], rows)
    message = _one_line_error(e)
    assert message.startswith("reward my_reward.py:check on row 1 (prompt 'Compute this carefully, please: 1 + 1")
    assert "..." in message and len(message) < 400  # the prompt is cut short
    for word in words:
        assert word in message, message


def test_a_messages_row_is_named_by_its_last_user_message_and_a_missing_answer_is_reported():
    with pytest.raises(RewardError, match=r"on row 0 \(prompt 'What is 48 \+ 17\?'\) raised ValueError: the row "
                                          r"has no 'answer' field"):
        score_completions(exact_match, "exact_match", ["65"], [{"messages": ROW["messages"]}])


def test_regex_typos_and_async_rewards_are_refused(tmp_path):
    """An empty pattern (only an empty completion would match), a mistyped placeholder (matched as
    literal text) and an async reward (its call returns a coroutine) fail when loaded."""
    with pytest.raises(RewardError, match="the pattern is empty"):
        regex_reward("")
    with pytest.raises(RewardError, match=r"holds \{answr\}, which is no placeholder"):
        regex_reward("{answr}")
    assert regex_reward(r"\{x\}")("{x}", {"answer": "1"}) == 1.0  # escaped braces stay literal
    file = tmp_path / "coro.py"
    file.write_text("async def reward(completion, row):\n    return 1.0\n")
    with pytest.raises(RewardError, match="async function"):
        load_reward(f"{file}:reward")
