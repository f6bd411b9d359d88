"""Prompt rows for online training (GRPO): JSONL rows -> each prompt's tokens, the row kept beside them.

A prompt row is a question and the answer a reward checks the policy's completion against::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "What is 48 + 17?"}],
     "answer": "65"}
    {"prompt": "Q: What is 48 + 17?\\nA:", "answer": 65}

``messages`` is the conversation before the reply (an optional system turn, then user and
assistant alternating, ending with the user's turn: the checks of :mod:`plait.data.sft_rows`),
rendered with the tokenizer's chat template and its generation prompt (the opened assistant
turn the model continues). A ``prompt`` string is raw text, given to the model as it is, with no
template, as raw ``prompt``/``completion`` SFT rows are: so a base model can be trained on a plain
format, and a conversation is written as ``messages``. ``answer`` is a string or a number (kept as
text); any other field is kept, since the row is what a reward receives. Every malformed row is a
:class:`DataError` naming ``file:line``, the field and the fix.

:func:`prepare_prompts` tokenizes every prompt (no special tokens added: the template writes its
own, as :func:`plait.heldout.exact_match` prompts them), refuses a prompt that leaves less than
``max_new_tokens`` of ``seq_len`` for its completion, splits the rows into train and validation
(the ``eval_source`` rows when given, else ``val_fraction`` of the source's rows, drawn by
``seed``) and writes a directory holding ``index.json`` (format :data:`PROMPTS_FORMAT`),
``train.jsonl`` and ``val.jsonl`` (one ``{"ids": [...], "row": {...}}`` per prompt) and the
tokenizer files that travel on with the trained model. As for prepared fine-tuning rows
(:mod:`plait.data.sft_prepare`), the directory is keyed by everything its content depends on,
reused when the key matches, written under a temporary name and renamed into place, and never
replaces a directory plait did not write. :class:`PromptDataset` serves one split.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from plait.data.chat_template import ChatTemplate, load_chat_template
from plait.data.dataset_files import files_digest, read_records, row_source_files
from plait.data.errors import DataError, RowError
from plait.data.sft_prepare import INDEX_FILE, read_index, rows_directory, split_rows
from plait.data.sft_rows import Message, parse_conversation_before_reply
from plait.data.sft_tokenize import plain_tokenizer
from plait.data.token_shards import TOKENIZER_FILE
from plait.data.tokenizer import cache_dir as resolve_cache_dir
from plait.data.tokenizer import find_eos, load_tokenizer_file, tokenizer_vocab_size
from plait.data.tokenizer_files import copy_model_use_files, file_sha256, model_use_digests, tokenizer_sha256
from plait.outputs.permissions import apply_umask

#: ``index.json`` ``format`` of a prepared prompts directory
PROMPTS_FORMAT = "plait-prompts-v1"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class PromptRow:
    """One prompt row: ``row`` is the JSON object as read, with ``answer`` as text; the prompt is
    ``conversation`` (rendered with the chat template) or ``prompt`` (raw text)."""

    where: str
    answer: str
    row: dict[str, Any]
    conversation: tuple[Message, ...] | None = None
    prompt: str | None = None


def _fail(where: str, field: str, problem: str, fix: str, reason: str) -> RowError:
    return RowError(f"{where}: field {field!r}: {problem}; {fix}", reason)


def _answer(record: dict[str, Any], where: str) -> str:
    if "answer" not in record:
        raise _fail(where, "answer", f"is missing (found keys {sorted(record)[:8]})",
                    "give the answer the reward checks the completion against", "missing_field")
    value = record["answer"]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _fail(where, "answer", f"is a {type(value).__name__}, expected a string or a number",
                    'write it as a JSON string ("65") or number (65)', "wrong_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(where, "answer", f"is {value}", "give a finite number or a string", "wrong_type")
    text = str(value)
    if not text.strip():
        raise _fail(where, "answer", "is empty", "give the answer text, or remove the row", "missing_field")
    return text


def parse_prompt_row(record: object, where: str) -> PromptRow:
    """One prompt row from its JSON value; :class:`RowError` (a :class:`DataError`) when it is malformed."""
    if not isinstance(record, dict):
        raise RowError(f"{where}: the line is a JSON {type(record).__name__}, expected an object with "
                       f"'prompt' or 'messages' and 'answer'", "bad_json")
    if "messages" in record and "prompt" in record:
        raise _fail(where, "messages", "is given together with prompt",
                    "keep one: prompt (raw text) or messages (the conversation before the reply)",
                    "conflicting_fields")
    answer = _answer(record, where)
    row = {**record, "answer": answer}
    if "messages" in record:
        return PromptRow(where, answer, row,
                         conversation=parse_conversation_before_reply(record["messages"], "messages", where))
    if "prompt" not in record:
        raise _fail(where, "prompt", f"is missing (found keys {sorted(record)[:8]})",
                    "give 'prompt' (raw text) or 'messages' (the conversation before the reply)", "missing_field")
    prompt = record["prompt"]
    if not isinstance(prompt, str):
        raise _fail(where, "prompt", f"is a {type(prompt).__name__}, expected a string",
                    "write the prompt as a JSON string", "wrong_type")
    if not prompt.strip():
        raise _fail(where, "prompt", "is empty", "give the prompt text, or remove the row", "missing_field")
    return PromptRow(where, answer, row, prompt=prompt)


def read_prompt_rows(path: str | os.PathLike | Sequence[Path], fields: Mapping[str, str] | None = None,
                     what: str = "data.source") -> list[PromptRow]:
    """The prompt rows of a row source (a JSONL, JSON, Parquet, CSV or Arrow file, a ``save_to_disk``
    directory, a glob, or a list of files; ``fields`` maps plait's column names to the files'; blank
    JSONL lines passed over); the first malformed row, or a source without rows, is a :class:`DataError`."""
    files = row_source_files(path, what) if isinstance(path, (str, os.PathLike)) else list(path)
    source = files[0] if len(files) == 1 else Path(str(path))
    rows = []
    for one in files:
        for where, value in read_records(one, "prompts", fields or {}):
            if isinstance(value, RowError):
                raise value
            rows.append(parse_prompt_row(value, where))
    if not rows:
        raise DataError(f"{source}: no prompt rows (the file is empty or only blank lines); give a .jsonl of "
                        f"prompt/answer rows, e.g. prompts_train.jsonl from `plait data task`")
    return rows


def render_prompt(row: PromptRow, template: ChatTemplate) -> str:
    """The text the model continues: the conversation with the template's generation prompt, or
    the raw ``prompt``."""
    if row.conversation is not None:
        return template.render([m.as_dict() for m in row.conversation], add_generation_prompt=True, where=row.where)
    assert row.prompt is not None
    return row.prompt


def _tokenize(rows: list[PromptRow], tokenizer: Tokenizer, template: ChatTemplate) -> list[list[int]]:
    plain = plain_tokenizer(tokenizer)
    out = []
    for row in rows:
        ids = plain.encode(render_prompt(row, template), add_special_tokens=False).ids
        if not ids:
            raise DataError(f"{row.where}: the prompt renders to no tokens; give the row a prompt, or remove it")
        out.append(list(ids))
    return out


def _check_lengths(rows: list[PromptRow], ids: list[list[int]], *, seq_len: int, max_new_tokens: int) -> None:
    """Every prompt leaves ``max_new_tokens`` of ``seq_len`` for its completion."""
    long = [i for i, tokens in enumerate(ids) if len(tokens) + max_new_tokens > seq_len]
    if not long:
        return
    first = long[0]
    n = len(ids[first])
    more = f" (and {len(long) - 1} more row(s))" if len(long) > 1 else ""
    raise DataError(f"{rows[first].where}: the prompt is {n} tokens, and with grpo.max_new_tokens={max_new_tokens} "
                    f"a sequence is {n + max_new_tokens} tokens, more than data.seq_len={seq_len}{more}; raise "
                    f"data.seq_len to {max(len(ids[i]) for i in long) + max_new_tokens}, lower "
                    f"grpo.max_new_tokens, or shorten or remove the row")


def _digest(files: list[Path]) -> str:
    return file_sha256(files[0]) if len(files) == 1 else files_digest(files)


def _key(source: list[Path], eval_source: list[Path] | None, tokenizer: Path, template: ChatTemplate,
         settings: dict) -> str:
    """Everything the directory depends on: the row files, every tokenizer file that travels with
    the model, the chat template as rendered and the settings."""
    text = json.dumps({"source": _digest(source), "eval_source": _digest(eval_source) if eval_source else None,
                       "tokenizer_files": model_use_digests(tokenizer), "template": template.text,
                       "bos_token": template.bos_token, "eos_token": template.eos_token, **settings,
                       "format": PROMPTS_FORMAT}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prompts_index(directory: str | os.PathLike) -> dict | None:
    """The ``index.json`` of a prepared prompts directory, else None."""
    return read_index(Path(directory).expanduser(), PROMPTS_FORMAT)


def prompts_directory(path: str | os.PathLike) -> Path | None:
    """``path`` as a prepared prompts directory, else None."""
    p = Path(path).expanduser()
    return p if prompts_index(p) is not None else None


def prepared_directory(data_format: str, source: str | os.PathLike) -> Path | None:
    """``source`` as a directory already prepared for ``data_format`` (prompts, or fine-tuning rows
    for ``sft`` and ``preference``), else None."""
    return prompts_directory(source) if data_format == "prompts" else rows_directory(source)


def prepare_prompts(source: str | os.PathLike, tokenizer: str | os.PathLike, *, seq_len: int, max_new_tokens: int,
                    val_fraction: float, seed: int, eval_source: str | os.PathLike | None = None,
                    cache_dir: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None,
                    fields: Mapping[str, str] | None = None) -> Path:
    """Prepare (or reuse) the prompts of ``source`` (a JSONL file) and return their directory; see
    the module doc. ``tokenizer`` is a ``tokenizer.json`` (its directory's
    ``tokenizer_config.json`` or ``chat_template.jinja`` gives the chat template); the directory
    is ``out_dir``, else one named by its key under ``cache_dir``'s ``datasets``."""
    src_files = row_source_files(source, "data.source")
    held_files = row_source_files(eval_source, "grpo.eval_source") if eval_source is not None else None
    src = src_files[0] if len(src_files) == 1 else Path(str(source))
    held = (held_files[0] if len(held_files) == 1 else Path(str(eval_source))) if held_files else None
    tok_path = Path(tokenizer).expanduser()
    if not tok_path.is_file():
        raise DataError(f"data.tokenizer {str(tokenizer)!r}: data.format 'prompts' needs the model's tokenizer.json "
                        f"(its chat template renders the prompts); no such file")
    template = load_chat_template(tok_path)
    settings: dict[str, Any] = {"seq_len": seq_len, "max_new_tokens": max_new_tokens, "val_fraction": val_fraction,
                                "seed": seed}
    if fields:  # only when given: the keys of prompts prepared before data.fields existed stay the same
        settings["fields"] = dict(sorted(fields.items()))
    key = _key(src_files, held_files, tok_path, template, settings)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", src.stem).strip("._") or "prompts"
    default = resolve_cache_dir(cache_dir) / "datasets" / f"{stem}-prompts-{key}"
    out = Path(out_dir).expanduser() if out_dir is not None else default
    found = prompts_index(out)
    if found is not None and found.get("key") == key:
        return out
    stale = out_dir is None and found is not None  # ours, made from other inputs: a new key names another path
    if out.exists() and not stale and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"data output {out} exists and is not this data's prepared directory; plait does not "
                        f"replace what it did not write: give an empty or new directory")
    tok = load_tokenizer_file(tok_path)
    template = load_chat_template(tok_path, tok)
    rows = read_prompt_rows(src_files, fields)
    if held_files is None:
        train_rows, val_rows = split_rows(rows, val_fraction, seed)
    else:
        train_rows, val_rows = rows, read_prompt_rows(held_files, fields)
    splits = {"train": train_rows, "val": val_rows}
    ids = {name: _tokenize(part, tok, template) for name, part in splits.items()}
    _check_lengths(train_rows + val_rows, ids["train"] + ids["val"], seq_len=seq_len, max_new_tokens=max_new_tokens)
    index = {"format": PROMPTS_FORMAT, "key": key, "kind": "prompts", **settings,
             "source": str(src), "eval_source": str(held) if held is not None else None,
             "eval_source_sha256": _digest(held_files) if held_files else None,
             "template": template.source, "template_sha256": hashlib.sha256(template.text.encode()).hexdigest(),
             "tokenizer_sha256": tokenizer_sha256(tok_path), "tokenizer_source": str(tok_path),
             "vocab_size": tokenizer_vocab_size(tok),
             "rows": {name: len(part) for name, part in splits.items()},
             "longest_prompt": {name: max(len(t) for t in ids[name]) for name in splits}}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, part in splits.items():
            with (tmp / f"{name}.jsonl").open("w", encoding="utf-8") as f:
                for row, tokens in zip(part, ids[name], strict=True):
                    f.write(json.dumps({"ids": tokens, "row": row.row}, ensure_ascii=False) + "\n")
        copy_model_use_files(tmp, tok_path)  # they travel on with the trained model
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1), encoding="utf-8")
        apply_umask(tmp)  # mkdtemp makes an owner-only directory
        if stale:
            shutil.rmtree(out)
        elif out.is_dir():
            out.rmdir()  # empty
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def describe_prompts(directory: str | os.PathLike) -> str:
    """One line for the report of ``plait train``: the prompts of each split and the longest."""
    index = prompts_index(directory)
    if index is None:
        raise DataError(f"{directory}: not a prepared prompts directory (no {PROMPTS_FORMAT} {INDEX_FILE})")
    where = "grpo.eval_source" if index.get("eval_source") else "held out from data.source"
    rows, longest = index["rows"], index["longest_prompt"]
    return (f"train {rows['train']} prompts, val {rows['val']} prompts ({where}); longest prompt "
            f"{max(longest.values())} tokens + {index['max_new_tokens']} new <= seq_len {index['seq_len']}")


def check_prompts_fit(directory: str | os.PathLike, *, seq_len: int, max_new_tokens: int) -> None:
    """Refuse prepared prompts whose longest prompt plus ``max_new_tokens`` exceeds ``seq_len``
    (a directory prepared for another recipe)."""
    index = prompts_index(directory) or {}
    longest = max((index.get("longest_prompt") or {}).values(), default=0)
    if longest + max_new_tokens > seq_len:
        raise DataError(f"data.source {str(directory)!r} holds prompts of up to {longest} tokens: with "
                        f"grpo.max_new_tokens={max_new_tokens} that is {longest + max_new_tokens} tokens, more than "
                        f"data.seq_len={seq_len}; raise data.seq_len to {longest + max_new_tokens} or lower "
                        f"grpo.max_new_tokens")


class PromptDataset:
    """One split of a prepared prompts directory: each prompt's token ids and its row."""

    def __init__(self, directory: str | os.PathLike, split: str = "train") -> None:
        self.directory = Path(directory)
        index = prompts_index(self.directory)
        if index is None:
            raise DataError(f"{self.directory}: not a prepared prompts directory (no {PROMPTS_FORMAT} {INDEX_FILE})")
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: a prompts directory has the splits {SPLITS}")
        self.index: dict[str, Any] = index
        self.split = split
        self.vocab_size = int(index["vocab_size"])
        self.seq_len = int(index["seq_len"])
        self.max_new_tokens = int(index["max_new_tokens"])
        self._ids: list[list[int]] = []
        self._rows: list[dict[str, Any]] = []
        path = self.directory / f"{split}.jsonl"
        with path.open(encoding="utf-8") as f:
            for line in f:
                entry = json.loads(line)
                self._ids.append(entry["ids"])
                self._rows.append(entry["row"])

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self, i: int) -> list[int]:
        """The token ids of prompt ``i`` (a copy: the caller may extend it)."""
        return list(self._ids[i])

    def row(self, i: int) -> dict[str, Any]:
        """Prompt ``i``'s row as read (``answer`` as text): what a reward receives."""
        return self._rows[i]

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer_file(self.directory / TOKENIZER_FILE)

    def chat_template(self) -> ChatTemplate:
        """The chat template the prompts were rendered with (it names the end-of-turn token)."""
        return load_chat_template(self.directory / TOKENIZER_FILE, self.tokenizer())

    @property
    def eos_id(self) -> int:
        return find_eos(self.tokenizer())[1]
