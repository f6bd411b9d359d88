"""Rows of supervised fine-tuning and preference data, read from JSONL and checked one by one.

An SFT row is either a conversation::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

(roles ``system``/``user``/``assistant``; ``system`` only first; ``user`` and ``assistant``
alternate starting with ``user``; the last turn is the assistant's; no assistant turn is empty),
or a raw text pair ``{"prompt": "...", "completion": "..."}`` trained without a chat template.

A preference row is a prompt and two answers::

    {"prompt": "...", "chosen": "...", "rejected": "..."}
    {"messages": [...the conversation before the answer, ending with a user turn...],
     "chosen": [{"role": "assistant", "content": "..."}], "rejected": "..."}

With ``messages``, or when ``chosen``/``rejected`` are assistant message lists, the row is a
conversation (a string ``prompt`` becomes one user turn); with a string ``prompt`` and string
answers it is raw text. The two answers must differ.

Every malformed row raises a :class:`DataError` naming ``file:line``, the field and the fix. With
``skip_bad_rows=True`` such rows are skipped instead and counted per reason (the codes of
:data:`REASONS`); the counts are returned so that the caller reports them. Blank lines are not
rows and are passed over.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from plait.data.dataset_files import read_records, row_source_files
from plait.data.errors import RowError

ROLES = ("system", "user", "assistant")
# Why a row was refused; the keys of the counts returned with skip_bad_rows=True.
REASONS = {
    "bad_utf8": "bytes that are not UTF-8",
    "bad_json": "not a JSON object",
    "missing_field": "a required field is missing",
    "conflicting_fields": "both the conversation and the raw-text form",
    "wrong_type": "a field of the wrong type",
    "bad_role": "an unknown role",
    "role_order": "roles out of order",
    "empty_assistant": "an empty answer",
    "chosen_equals_rejected": "the two answers are equal",
}


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class SFTRow:
    """A conversation (``messages``, ending with the assistant) or raw ``prompt`` + ``completion``."""

    where: str
    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    completion: str | None = None


@dataclass(frozen=True)
class PreferenceRow:
    """A prompt and two answers. ``conversation`` is the chat before the answer (None for raw text,
    where ``prompt`` holds the text); ``chosen``/``rejected`` are the answers' text."""

    where: str
    chosen: str
    rejected: str
    conversation: tuple[Message, ...] | None = None
    prompt: str | None = None


def _fail(where: str, field: str, problem: str, fix: str, reason: str) -> RowError:
    return RowError(f"{where}: field {field!r}: {problem}; {fix}", reason)


def _string(record: dict[str, Any], key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise _fail(where, key, f"is a {type(value).__name__}, expected a string", f"write {key} as a JSON string",
                    "wrong_type")
    return value


def _message(item: object, field: str, where: str) -> Message:
    if not isinstance(item, dict):
        raise _fail(where, field, f"is a {type(item).__name__}, expected an object with role and content",
                    'write each message as {"role": ..., "content": ...}', "wrong_type")
    for key in ("role", "content"):
        if key not in item:
            raise _fail(where, f"{field}.{key}", "is missing", 'write each message as {"role": ..., "content": ...}',
                        "missing_field")
    role, content = item["role"], item["content"]
    if not isinstance(role, str) or role not in ROLES:
        raise _fail(where, f"{field}.role", f"is {role!r}", f"use one of {', '.join(ROLES)}", "bad_role")
    if not isinstance(content, str):
        raise _fail(where, f"{field}.content", f"is a {type(content).__name__}, expected a string",
                    "write the content as a JSON string", "wrong_type")
    return Message(role, content)


def _messages(value: object, field: str, where: str) -> tuple[Message, ...]:
    if not isinstance(value, list):
        raise _fail(where, field, f"is a {type(value).__name__}, expected a list of messages",
                    'write it as [{"role": ..., "content": ...}, ...]', "wrong_type")
    return tuple(_message(item, f"{field}[{i}]", where) for i, item in enumerate(value))


def _check_turns(messages: tuple[Message, ...], field: str, where: str, *, last: str) -> None:
    """System only first, then user/assistant alternating from user, the last turn being ``last``."""
    if not messages:
        turns = "a user turn and an assistant turn" if last == "assistant" else "a user turn"
        raise _fail(where, field, "is empty", f"give at least {turns}", "missing_field")
    start = 1 if messages[0].role == "system" else 0
    for i, m in enumerate(messages[start:], start):
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if m.role != expected:
            where_sys = " (system is allowed only as the first turn)" if m.role == "system" else ""
            raise _fail(where, f"{field}[{i}].role", f"is {m.role!r} where {expected!r} was expected{where_sys}",
                        "start with an optional system turn, then alternate user and assistant", "role_order")
    if messages[-1].role != last:
        raise _fail(where, f"{field}[{len(messages) - 1}].role", f"is {messages[-1].role!r}, the last turn must be "
                    f"{last!r}", f"end the conversation with a {last} turn", "role_order")
    for i, m in enumerate(messages):
        if m.role == "assistant" and not m.content.strip():
            raise _fail(where, f"{field}[{i}].content", "is an empty assistant turn",
                        "give the assistant text, or remove the row", "empty_assistant")


def parse_sft_row(record: object, where: str) -> SFTRow:
    """One SFT row from its JSON value; :class:`RowError` when it is malformed."""
    if not isinstance(record, dict):
        raise RowError(f"{where}: the line is a JSON {type(record).__name__}, expected an object with "
                       f"'messages' or 'prompt' and 'completion'", "bad_json")
    has_chat, has_raw = "messages" in record, ("prompt" in record or "completion" in record)
    if has_chat and has_raw:
        raise _fail(where, "messages", "is given together with prompt/completion",
                    "keep one form: a messages conversation, or prompt and completion", "conflicting_fields")
    if has_chat:
        messages = _messages(record["messages"], "messages", where)
        _check_turns(messages, "messages", where, last="assistant")
        return SFTRow(where, messages=messages)
    for key in ("prompt", "completion"):
        if key not in record:
            raise _fail(where, key, f"is missing (found keys {sorted(record)[:8]})",
                        "give 'messages' (a conversation) or both 'prompt' and 'completion'", "missing_field")
    prompt, completion = _string(record, "prompt", where), _string(record, "completion", where)
    if not completion.strip():
        raise _fail(where, "completion", "is empty", "give the completion text, or remove the row", "empty_assistant")
    return SFTRow(where, prompt=prompt, completion=completion)


def _answer(record: dict[str, Any], key: str, where: str) -> tuple[str, bool]:
    """An answer's text and whether it was given as an assistant message list."""
    if key not in record:
        raise _fail(where, key, "is missing", "give both 'chosen' and 'rejected'", "missing_field")
    value = record[key]
    if isinstance(value, str):
        text, listed = value, False
    else:
        messages = _messages(value, key, where)
        if len(messages) != 1 or messages[0].role != "assistant":
            raise _fail(where, key, f"has roles {[m.role for m in messages]}, expected one assistant message",
                        'write it as [{"role": "assistant", "content": ...}] or as a string', "role_order")
        text, listed = messages[0].content, True
    if not text.strip():
        raise _fail(where, key, "is an empty answer", "give the answer text, or remove the row", "empty_assistant")
    return text, listed


def parse_preference_row(record: object, where: str) -> PreferenceRow:
    """One preference row from its JSON value; :class:`RowError` when it is malformed."""
    if not isinstance(record, dict):
        raise RowError(f"{where}: the line is a JSON {type(record).__name__}, expected an object with "
                       f"'prompt' or 'messages', 'chosen' and 'rejected'", "bad_json")
    if "messages" in record and "prompt" in record:
        raise _fail(where, "messages", "is given together with prompt",
                    "keep one: prompt (a string) or messages (the conversation before the answer)",
                    "conflicting_fields")
    if "messages" not in record and "prompt" not in record:
        raise _fail(where, "prompt", f"is missing (found keys {sorted(record)[:8]})",
                    "give 'prompt' (a string) or 'messages' (the conversation before the answer)", "missing_field")
    chosen, chosen_listed = _answer(record, "chosen", where)
    rejected, rejected_listed = _answer(record, "rejected", where)
    if chosen == rejected:
        raise _fail(where, "rejected", "equals 'chosen'", "give two different answers, or remove the row",
                    "chosen_equals_rejected")
    if "messages" in record:
        conversation = parse_conversation_before_reply(record["messages"], "messages", where)
        return PreferenceRow(where, chosen, rejected, conversation=conversation)
    prompt = _string(record, "prompt", where)
    if chosen_listed or rejected_listed:
        return PreferenceRow(where, chosen, rejected, conversation=(Message("user", prompt),))
    return PreferenceRow(where, chosen, rejected, prompt=prompt)


def parse_conversation_before_reply(value: object, field: str, where: str) -> tuple[Message, ...]:
    """The conversation before a reply (preference and prompt rows): messages with an optional
    system turn first, then user and assistant alternating, ending with the user's turn;
    :class:`RowError` naming ``where`` and ``field`` when it is malformed."""
    conversation = _messages(value, field, where)
    _check_turns(conversation, field, where, last="user")
    return conversation


Row = TypeVar("Row", SFTRow, PreferenceRow)


def _read(path: str | os.PathLike | Sequence[Path], parse: Callable[[object, str], Row], data_format: str,
          skip_bad_rows: bool, fields: Mapping[str, str] | None) -> tuple[list[Row], Counter[str]]:
    files = row_source_files(path) if isinstance(path, (str, os.PathLike)) else list(path)
    rows: list[Row] = []
    skipped: Counter[str] = Counter()
    for source in files:
        for where, value in read_records(source, data_format, fields or {}):
            try:
                if isinstance(value, RowError):
                    raise value
                rows.append(parse(value, where))
            except RowError as exc:
                if not skip_bad_rows:
                    raise
                skipped[exc.reason] += 1
    return rows, skipped


def read_sft_rows(path: str | os.PathLike | Sequence[Path], *, skip_bad_rows: bool = False,
                  fields: Mapping[str, str] | None = None) -> tuple[list[SFTRow], Counter[str]]:
    """The SFT rows of a row source (a JSONL, JSON, Parquet, CSV or Arrow file, a ``save_to_disk``
    directory, a glob, or a list of files; ``fields`` maps plait's column names to the files') and
    the count of skipped rows per reason (empty unless skipping)."""
    return _read(path, parse_sft_row, "sft", skip_bad_rows, fields)


def read_preference_rows(path: str | os.PathLike | Sequence[Path], *, skip_bad_rows: bool = False,
                         fields: Mapping[str, str] | None = None) -> tuple[list[PreferenceRow], Counter[str]]:
    """The preference rows of a row source (as :func:`read_sft_rows`) and the count of skipped rows per reason."""
    return _read(path, parse_preference_row, "preference", skip_bad_rows, fields)


def describe_skipped(skipped: Counter[str]) -> str:
    """One line for the report: ``skipped 3 rows: 2 bad_json (not a JSON object), 1 ...``."""
    if not skipped:
        return "skipped no rows"
    parts = [f"{n} {reason} ({REASONS.get(reason, reason)})" for reason, n in sorted(skipped.items())]
    return f"skipped {sum(skipped.values())} rows: {', '.join(parts)}"
