"""Verifiable rewards for GRPO: built-ins, a user's function from a file, and checked scoring.

A reward is any callable ``(completion: str, row: dict) -> float``: ``completion`` is the decoded
text the policy generated and ``row`` the prompt row as read from the JSONL file (it has an
``answer`` and a ``prompt`` or ``messages``, and whatever other fields the user keeps there).

A user's reward runs inside training, after minutes of start-up and generation, so everything
that can be checked is checked when the reward is loaded, before any training starts
(:func:`load_reward`), and every call is checked as it is scored (:func:`score_completions`):
each problem is a :class:`RewardError` with one line naming the reward, what went wrong and
the fix, never a traceback from deep inside the loop.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
import re
import sys
import types
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

Reward = Callable[[str, dict], float]
#: the names :func:`load_reward` knows besides ``FILE.py:FUNCTION``
BUILTINS: tuple[str, ...] = ("exact_match", "regex")
#: stands for the row's answer (regex-escaped) in a :func:`regex_reward` pattern
ANSWER = "{answer}"
_PROMPT_CHARS = 60


class RewardError(ValueError):
    """A reward that cannot be loaded, or a call of it that failed or returned no usable number."""


def _one_line(text: str, limit: int | None = None) -> str:
    flat = " ".join(text.split())
    return flat if limit is None or len(flat) <= limit else flat[:limit - 3] + "..."


def _answer(row: dict) -> str:
    if "answer" not in row:
        raise ValueError(f"the row has no 'answer' field (it has {sorted(row)})")
    return str(row["answer"]).strip()


# ------------------------------------------------------------------------------------- built-ins
def exact_match(completion: str, row: dict) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is the row's answer, else 0.0."""
    return 1.0 if completion.strip() == _answer(row) else 0.0


def regex_reward(pattern: str) -> Reward:
    """A reward that is 1.0 when ``re.fullmatch(pattern, completion.strip())`` matches, else 0.0.

    ``{answer}`` in the pattern stands for the row's answer, regex-escaped, so one pattern can
    accept formats around the right number: ``(The answer is )?{answer}\\.?``. (``{answer}`` is
    not a regex quantifier, so the placeholder takes nothing from the regex language.) The
    pattern is compiled here, with a sample answer in the placeholder: a bad pattern is a
    :class:`RewardError` naming it before any training starts.
    """
    if not pattern:
        raise RewardError("regex reward: the pattern is empty, which only an empty completion matches; give the "
                          "regular expression a right completion matches, e.g. {answer}")
    unknown = sorted(set(re.findall(r"\{([A-Za-z_]\w*)\}", pattern)) - {ANSWER[1:-1]})
    if unknown:
        raise RewardError(f"regex reward: pattern {pattern!r} holds {{{unknown[0]}}}, which is no placeholder (the "
                          f"only one is {ANSWER}) and would match that text literally; write {ANSWER}, or "
                          f"\\{{{unknown[0]}\\}} for literal braces")
    templated = ANSWER in pattern
    try:
        compiled = re.compile(pattern.replace(ANSWER, re.escape("0")) if templated else pattern)
    except re.error as e:
        raise RewardError(f"regex reward: pattern {pattern!r} does not compile ({e}); fix the regular "
                          f"expression") from None

    def regex(completion: str, row: dict) -> float:
        if templated:  # re caches compiled patterns, so a repeated answer compiles once
            return 1.0 if re.fullmatch(pattern.replace(ANSWER, re.escape(_answer(row))), completion.strip()) else 0.0
        return 1.0 if compiled.fullmatch(completion.strip()) else 0.0

    return regex


# ------------------------------------------------------------------------------------ user files
def _import_file(spec: str, path: Path) -> types.ModuleType:
    """Import ``path`` as a fresh module under a unique name, ``plait_reward_<stem>_<hex>`` (two
    files called ``reward.py`` do not collide, and loading again never reuses an earlier import).
    The module stays in ``sys.modules``, where pickling and dataclasses look it up by name."""
    name = f"plait_reward_{path.stem}_{uuid.uuid4().hex}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"reward {spec!r}: {path} cannot be imported as a Python module; give a .py file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise RewardError(f"reward {spec!r}: importing {path} raised {type(e).__name__}: "
                          f"{_one_line(str(e), 300)}; fix the file so that it imports") from None
    return module


def _check_signature(spec: str, attr: str, fn: Callable) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature to read: nothing to check
        return
    try:
        signature.bind("completion", {})
    except TypeError as e:
        raise RewardError(f"reward {spec!r}: {attr}{signature} cannot be called as {attr}(completion, row) ({e}); "
                          f"define it as def {attr}(completion: str, row: dict) -> float") from None


def _load_user_reward(spec: str) -> Reward:
    file, _, attr = spec.rpartition(":")
    if not file or not attr:
        raise RewardError(f"reward {spec!r}: give FILE.py:FUNCTION (both parts), or one of {BUILTINS}")
    path = Path(file).expanduser()
    if not path.exists():
        raise RewardError(f"reward {spec!r}: {path} does not exist; give the path of a .py file (relative to the "
                          f"working directory {Path.cwd()})")
    if path.is_dir():
        raise RewardError(f"reward {spec!r}: {path} is a directory; give the path of a .py file in it")
    if path.suffix != ".py":
        raise RewardError(f"reward {spec!r}: {path} is not a .py file; give a Python file FILE.py:FUNCTION")
    module = _import_file(spec, path)
    if not hasattr(module, attr):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise RewardError(f"reward {spec!r}: {path} defines no {attr!r}; it defines "
                          f"{', '.join(defined) or 'no public function'}; fix the name after the colon")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {attr} in {path} is not callable (of type {type(fn).__name__}); give "
                          f"a function (completion, row) -> float")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise RewardError(f"reward {spec!r}: {attr} is an async function, whose call returns a coroutine, not a "
                          f"number; make it a plain def")
    _check_signature(spec, attr, fn)
    return fn


def load_reward(spec: str, *, pattern: str | None = None) -> Reward:
    """The reward that ``spec`` names, checked before any training starts.

    ``spec``: ``exact_match`` (:func:`exact_match`), ``regex`` (:func:`regex_reward` of
    ``pattern``, which it needs) or ``path/to/file.py:function``: the file must exist and be a
    ``.py`` file, import without an exception, and define ``function``, a callable that accepts
    ``(completion, row)`` positionally. The file is imported as a fresh module (its own imports
    resolve through ``sys.path`` as usual; its folder is not added). ``pattern`` is refused for
    anything but ``regex``. Every failure is a :class:`RewardError` of one line.
    """
    if pattern is not None and spec != "regex":
        raise RewardError(f"reward {spec!r}: a pattern ({pattern!r}) applies only to the 'regex' reward; drop it "
                          f"or use reward 'regex'")
    if spec == "exact_match":
        return exact_match
    if spec == "regex":
        if pattern is None:
            raise RewardError("reward 'regex' needs a pattern (a regular expression the whole stripped completion "
                              "must match, {answer} standing for the row's answer); give one")
        return regex_reward(pattern)
    if ":" not in spec:
        raise RewardError(f"reward {spec!r} is not known; choose one of {BUILTINS} or give FILE.py:FUNCTION")
    return _load_user_reward(spec)


# --------------------------------------------------------------------------------------- scoring
def _prompt_of(row: dict) -> str:
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    users = [m.get("content") for m in row.get("messages") or () if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else "?"


def _as_number(value: object) -> float | None:
    """``value`` as a float when it is a real number (a bool, an int, a float, a numpy scalar, a 0-d
    real tensor), else None."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex():
            return None
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def score_completions(reward: Reward, name: str, completions: list[str], rows: list[dict]) -> list[float]:
    """``reward(completions[i], rows[i])`` for each ``i``, as floats.

    A call that raises, or returns anything but a finite real number (bool, int, float, a numpy
    scalar or a 0-d real tensor), is a :class:`RewardError` of one line naming the reward
    (``name``), the index ``i`` of the row in ``rows``, the row's prompt (truncated) and what the
    call raised or returned.
    """
    if len(completions) != len(rows):
        raise ValueError(f"score_completions: {len(completions)} completions for {len(rows)} rows; give one "
                         f"row per completion")
    scores = []
    for i, (completion, row) in enumerate(zip(completions, rows, strict=True)):
        where = f"reward {name} on row {i} (prompt {_one_line(_prompt_of(row), _PROMPT_CHARS)!r})"
        try:
            value = reward(completion, row)
        except Exception as e:
            raise RewardError(f"{where} raised {type(e).__name__}: {_one_line(str(e), 200)}; fix the reward "
                              f"function") from None
        number = _as_number(value)
        if number is None:
            raise RewardError(f"{where} returned {_one_line(repr(value), 80)} (of type {type(value).__name__}); "
                              f"return a float (or an int or bool)")
        if not math.isfinite(number):
            raise RewardError(f"{where} returned {number}; return a finite float")
        scores.append(number)
    return scores
