"""A shaped reward for the arithmetic task (``grpo.reward: recipes/rewards/arithmetic.py:reward``).

Exact match alone gives an instruct model that explains its answers ("18 * 2 = 36, so...") no
signal: every completion of a group scores 0, so every advantage is 0. This reward keeps exact
match's top score for the asked answer (the number only) and ranks the near misses below it:
the right number inside other words, then a bare number that is wrong (the asked format). A group
that is partly right then has a gradient towards both the number and the format.
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
    if NUMBER.fullmatch(text):
        return 0.1
    return 0.0
