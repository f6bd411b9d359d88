"""A small fine-tuning task that needs no download: two-number arithmetic in a fixed answer format.

Nothing can be fetched at run time, so the post-training recipes train and score on a task
generated here, deterministically from a seed: questions such as ``What is 48 + 17? Answer with
the number only.`` whose answer is exact and checkable (``65``). The SFT file holds conversations;
the preference file pairs the right answer (chosen) with a near miss (rejected: off by a small
amount, or the right number in a chatty, wrong format). The prompt file holds the same
questions without the reply, with the answer beside them (``answer``), for online training
with a verifiable reward (GRPO: the policy writes the reply, a reward checks it). The held-out
files use operand pairs the training files never contain, so a gain on them is generalisation,
not recall; every split holds the same problems in its SFT, preference and prompt files, so
scores on them are comparable.

``write_task_files(directory, seed)`` writes ``sft_train.jsonl``, ``sft_heldout.jsonl``,
``preference_train.jsonl``, ``preference_heldout.jsonl``, ``prompts_train.jsonl`` and
``prompts_heldout.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

OPERATORS = ("+", "-", "*")
#: operand ranges (inclusive): ``a`` in LOW..HIGH, ``b`` in LOW..HIGH, or LOW..TIMES_HIGH for ``*``
LOW, HIGH, TIMES_HIGH = 2, 99, 12
TASK_FILES = ("sft_train.jsonl", "sft_heldout.jsonl", "preference_train.jsonl", "preference_heldout.jsonl",
              "prompts_train.jsonl", "prompts_heldout.jsonl")
SYSTEM = "You are a careful calculator. Reply with the number only."


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}? Answer with the number only."

    @property
    def answer(self) -> str:
        value = self.a + self.b if self.op == "+" else self.a - self.b if self.op == "-" else self.a * self.b
        return str(value)


def _is_heldout(a: int, b: int) -> bool:
    return (a + b) % 5 == 0


def max_problems(heldout: bool) -> int:
    """How many distinct problems there are of a kind: the most ``--train`` (``heldout=False``) or
    ``--heldout`` can ask for (16228 and 4058)."""
    return sum(_is_heldout(a, b) == heldout for op in OPERATORS for a in range(LOW, HIGH + 1)
               for b in range(LOW, (HIGH if op != "*" else TIMES_HIGH) + 1))


def check_counts(train: int, heldout: int) -> None:
    """``ValueError`` naming the option unless both counts are between 1 and :func:`max_problems`
    (the problems are distinct, so no more can be drawn)."""
    for option, count, kind in (("--train", train, False), ("--heldout", heldout, True)):
        most = max_problems(kind)
        if not 1 <= count <= most:
            raise ValueError(f"{option} {count}: the task has {most} distinct {'held-out' if kind else 'training'} "
                             f"problems; give {option} between 1 and {most}")


def _problems(rng: random.Random, count: int, heldout: bool) -> list[Problem]:
    """Distinct problems; held-out ones have ``(a + b) % 5 == 0``, training ones never do."""
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < count:
        op = rng.choice(OPERATORS)
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH if op != "*" else TIMES_HIGH)
        p = Problem(a, op, b)
        if _is_heldout(a, b) != heldout or p in seen:
            continue
        seen.add(p)
        out.append(p)
    return out


def _near_miss(rng: random.Random, p: Problem) -> str:
    if rng.random() < 0.5:
        return f"The answer is {p.answer}."  # right number, wrong format
    return str(int(p.answer) + rng.choice((-10, -2, -1, 1, 2, 10)))


def sft_row(p: Problem) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p.question},
                         {"role": "assistant", "content": p.answer}]}


def preference_row(rng: random.Random, p: Problem) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p.question}],
            "chosen": p.answer, "rejected": _near_miss(rng, p)}


def prompt_row(p: Problem) -> dict:
    """The question without the reply, and the answer a reward checks the policy's reply against."""
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p.question}],
            "answer": p.answer}


def write_task_files(directory: str | Path, seed: int = 0, *, train: int = 2000, heldout: int = 200) -> dict[str, Path]:
    """Write the six JSONL files (see the module doc); returns their paths by name.

    The counts are checked (:func:`check_counts`) and the problems drawn before anything is written;
    if writing fails, the files it created and the directories it made are removed again.
    """
    check_counts(train, heldout)
    out = Path(directory)
    rng = random.Random(seed)
    train_problems, heldout_problems = _problems(rng, train, False), _problems(rng, heldout, True)
    files = {
        "sft_train": [sft_row(p) for p in train_problems],
        "sft_heldout": [sft_row(p) for p in heldout_problems],
        "preference_train": [preference_row(rng, p) for p in train_problems],
        "preference_heldout": [preference_row(rng, p) for p in heldout_problems],
        # prompt rows draw nothing from rng, so the other files of a seed do not depend on them
        "prompts_train": [prompt_row(p) for p in train_problems],
        "prompts_heldout": [prompt_row(p) for p in heldout_problems],
    }
    created = [d for d in (out, *out.parents) if not d.exists()]
    paths = {name: out / f"{name}.jsonl" for name in files}
    new = [path for path in paths.values() if not path.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, rows in files.items():
            paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    except BaseException:
        for path in new:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        for d in created:  # innermost first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return paths
