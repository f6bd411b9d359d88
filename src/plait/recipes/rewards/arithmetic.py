"""A shaped reward for the arithmetic task (``grpo.reward: recipes/rewards/arithmetic.py:reward``).

Exact match alone gives an instruct model that explains its answers ("18 * 2 = 36, so...") no
signal: every completion of a group scores 0, so every advantage is 0. This reward keeps exact
match's top score for the asked answer (the right number alone) and gives part of it to the right
number inside other words, so a group that is partly right has a gradient towards the number and
then towards the format. A wrong number scores 0 however it is written: a reward for the bare
format alone is learned in a few steps and leaves every completion of a group equal (measured:
the policy collapsed onto bare wrong numbers, reward 0.1 everywhere, no gradient).
"""

import re

NUMBER = re.compile(r"-?\d+")


def reward(completion: str, row: dict) -> float:
    answer = str(row["answer"]).strip()
    text = completion.strip()
    if text == answer:
        return 1.0
    if answer in NUMBER.findall(text):
        return 0.3
    return 0.0
