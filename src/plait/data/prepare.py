"""Text sources -> a prepared dataset: tokenised train/val token shards (see ``token_shards``).

``prepare_dataset`` reads a source twice, streaming: a first pass counts the documents and their
lengths (to choose the held-out documents), a second one tokenises them into the shards. BPE
training reads the training documents only, so no validation text shapes the tokenizer.

The output directory is named by a key of every input (source contents or corpus name and package
version, tokenizer, vocab size, val fraction, seed, limit): a rerun with the same inputs finds it
and returns at once. A source that is itself a prepared dataset is used as it is, with its own
tokenizer. Callers check what they get with ``checks.verify_prepared`` (a reused directory may
have been damaged since it was written). The dataset is written into a temporary sibling directory that is renamed
into place at the end, so an interrupted run never leaves a directory that would be reused.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from plait import __version__ as plait_version
from plait.data.corpora import CORPORA, corpus_documents, corpus_version
from plait.data.dataset_files import (
    check_columns,
    expand_source,
    is_glob,
    is_saved_dataset,
    read_records,
    text_column_values,
)
from plait.data.errors import DataError, RowError
from plait.data.parallel_tokenize import encode_in_order
from plait.data.token_shards import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_FILE,
    SHARD_TOKENS,
    TOKENIZER_FILE,
    ShardWriter,
    load_index,
    token_dtype,
)
from plait.data.tokenizer import (
    EOS,
    EOS_CANDIDATES,  # noqa: F401 - re-exported
    find_eos,
    load_tokenizer_file,
    tokenizer_vocab_size,
    train_bpe,
)
from plait.data.tokenizer import cache_dir as resolve_cache_dir
from plait.data.tokenizer_files import copy_model_use_files, file_sha256, model_use_digests

SOURCE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".csv", ".arrow")
#: what a source directory is searched for (table files are named by a glob: a directory may hold others)
DIRECTORY_SUFFIXES = (".txt", ".jsonl")
_ENCODE_BATCH_DOCS, _ENCODE_BATCH_CHARS = 256, 4_000_000


class DataSourceError(DataError):
    """A source or tokenizer that cannot be read: missing path, empty source, bad JSONL line, unknown corpus."""


@dataclass
class _Source:
    name: str  # for the default directory name
    description: str  # for messages and the index
    key_parts: list[str]
    documents: Callable[[], Iterator[str]]  # a fresh iterator over the non-empty documents, in a fixed order


# ----------------------------------------------------------------------------------------- sources

def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _txt_documents(path: Path) -> Iterator[str]:
    """A .txt file is one document, or several when it contains the end-of-text marker between them."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataSourceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for doc in text.split(EOS):
        if doc.strip():
            yield doc


def _jsonl_documents(path: Path, column: str = "text") -> Iterator[str]:
    """One document per line: the line's text field (``column``); blank lines and empty texts are skipped."""
    lineno = 0
    named = f"'{column}'" + (" (data.fields.text)" if column != "text" else "")
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataSourceError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
                if not isinstance(record, dict) or column not in record:
                    found = f"keys {sorted(record)[:8]}" if isinstance(record, dict) else type(record).__name__
                    raise DataSourceError(f"{path}:{lineno}: no {named} field (found {found}); every JSONL line "
                                          f"must be an object with a string {named}; name another field with "
                                          f"data.fields: {{text: FIELD}}")
                text = record[column]
                if not isinstance(text, str):
                    raise DataSourceError(f"{path}:{lineno}: {named} is {type(text).__name__}, expected a string")
                if text:
                    yield text
    except UnicodeDecodeError as exc:
        raise DataSourceError(f"{path}:{lineno + 1}: not UTF-8 text ({exc.reason})") from None


def _table_documents(path: Path, fields: Mapping[str, str]) -> Iterator[str]:
    """The text column of a Parquet, Arrow, CSV or JSON file, streamed; nulls and empty texts skipped."""
    column = fields.get("text", "text")
    values = (text_column_values(path, fields) if path.suffix.lower() != ".json" else
              ((where, record.get("text") if isinstance(record, dict) else record)
               for where, record in read_records(path, "text", fields)))
    for where, value in values:
        if isinstance(value, RowError):
            raise value
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataSourceError(f"{where}: column {column!r} is {type(value).__name__}, expected a string; name "
                                  f"the text column with data.fields: {{text: COLUMN}}")
        if value:
            yield value


def _file_documents(path: Path, fields: Mapping[str, str] | None = None) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _txt_documents(path)
    if suffix == ".jsonl":
        return _jsonl_documents(path, (fields or {}).get("text", "text"))
    return _table_documents(path, fields or {})


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "data"


def resolve_source(source: str | Path, fields: Mapping[str, str] | None = None) -> _Source:
    """A built-in corpus name (preferred when it matches exactly; write ``./bible`` for a local path),
    a text file (.txt, or a table file: .jsonl, .json, .parquet, .csv, .arrow), a glob of them, a
    ``save_to_disk`` directory, or a directory searched recursively for such files (sorted by path).
    ``fields`` names the text column (``{"text": "body"}``). A prepared dataset is not a source to
    tokenise: :func:`prepared_source` finds it first."""
    source_str = str(source)
    fields = dict(fields or {})
    column = fields.get("text", "text")
    column_key = [f"fields.text={column}"] if column != "text" else []  # old keys stay the same without a map
    if source_str in CORPORA:
        if fields:
            raise DataSourceError(f"data.fields {fields} does not apply to the built-in corpus {source_str!r} (it "
                                  f"has no columns); remove data.fields")
        docs_cache: list[str] = []

        def corpus_docs() -> Iterator[str]:
            if not docs_cache:
                docs_cache.extend(d for d in corpus_documents(source_str) if d.strip())
            return iter(docs_cache)

        return _Source(source_str, f"corpus {source_str}",
                       [f"corpus:{source_str}", corpus_version(source_str)], corpus_docs)
    listed = expand_source(source_str, SOURCE_SUFFIXES)
    if listed is not None:
        for f in listed:
            if f.suffix.lower() not in (".txt", ".jsonl"):
                check_columns(f, "text", fields)  # a missing or mistyped column: before any reading
        name = _safe_name(listed[0].parent.name if len(listed) > 1 or is_saved_dataset(listed[0].parent)
                          else listed[0].stem)
        if len(listed) == 1 and not is_glob(source_str) and not is_saved_dataset(listed[0].parent):
            path = listed[0]
            return _Source(name, str(path), [f"file{path.suffix.lower()}", _hash_file(path), *column_key],
                           lambda: _file_documents(path, fields))
        parts = ["files"] + [f"{f.name}:{_hash_file(f)}" for f in listed] + column_key
        return _Source(name, source_str, parts,
                       lambda: itertools.chain.from_iterable(_file_documents(f, fields) for f in listed))
    path = Path(source_str).expanduser()
    if not path.exists():
        raise DataSourceError(f"source {source_str!r} is neither a built-in corpus ({', '.join(CORPORA)}) nor an "
                              f"existing file, directory or glob ({', '.join(SOURCE_SUFFIXES)})")
    if path.is_file():
        raise DataSourceError(f"source file {path} has suffix {path.suffix!r}; expected .txt (plain text), .jsonl "
                              f"or .json (a 'text' field per row), .parquet, .csv or .arrow (a 'text' column)")
    files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DIRECTORY_SUFFIXES),
                   key=lambda p: p.relative_to(path).as_posix())
    if not files:
        if (path / INDEX_FILE).is_file():
            load_index(path)  # a prepared dataset's unreadable index: say what is wrong with it
        tables = sorted({p.suffix.lower() for p in path.rglob("*") if p.suffix.lower() in SOURCE_SUFFIXES})
        hint = (f"; it holds {', '.join(tables)} files: name them with a glob, e.g. {path}/*{tables[0]}"
                if tables else "")
        raise DataSourceError(f"source directory {path} contains no .txt or .jsonl files and is not a prepared "
                              f"dataset (no {INDEX_FILE}){hint}")
    parts = ["dir"] + [f"{p.relative_to(path).as_posix()}:{_hash_file(p)}" for p in files] + column_key
    return _Source(_safe_name(path.resolve().name), str(path), parts,
                   lambda: itertools.chain.from_iterable(_file_documents(p, fields) for p in files))


# --------------------------------------------------------------------------------------- tokenizer

def _tokenizer_file(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataSourceError(f"tokenizer {spec!r} is neither 'bpe' nor an existing tokenizer.json file "
                              f"(or a directory holding one)")
    return path


# -------------------------------------------------------------------------------- prepared source

def prepared_source(source: str | Path) -> Path | None:
    """``source`` as a directory written by ``plait data prepare`` (an ``index.json`` of this format),
    else None. An ``index.json`` of another kind leaves the directory a plain source of text files."""
    if str(source) in CORPORA:
        return None
    path = Path(str(source)).expanduser()
    return path if _holds_prepared_index(path) else None


def _holds_prepared_index(path: Path) -> bool:
    """Whether ``path`` has an ``index.json`` that says it is of this format (readable or not beyond that)."""
    index = path / INDEX_FILE
    if not path.is_dir() or not index.is_file():
        return False
    try:
        found = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and found.get("format") == FORMAT


def _use_prepared(path: Path, tokenizer: str, out_dir: str | Path | None) -> Path:
    """A prepared source is used as it is (callers check it with :func:`~plait.data.checks.verify_prepared`):
    it is not tokenised again, so a different tokenizer or another output directory would be silently
    ignored; both are refused."""
    load_index(path)
    if out_dir is not None and Path(out_dir).expanduser().resolve() != path.resolve():
        raise DataSourceError(f"source {path} is already a prepared dataset; use it directly instead of "
                              f"preparing it into {out_dir}")
    if str(tokenizer) != "bpe":
        given = _tokenizer_file(str(tokenizer))
        own = path / str(load_index(path).get("tokenizer", TOKENIZER_FILE))
        if _hash_file(given) != _hash_file(own):
            raise DataSourceError(f"tokenizer {given} is not the tokenizer of the prepared dataset {path} ({own}); "
                                  f"a prepared source brings its own: leave data.tokenizer at 'bpe' or set it "
                                  f"to {own}")
    return path


# ------------------------------------------------------------------------------------- val split

def choose_val_documents(lengths: list[int], val_fraction: float, seed: int) -> set[int]:
    """Whole documents for validation: in an order shuffled by ``seed``, documents are taken until they
    hold ``val_fraction`` of the characters (a proxy for tokens; the last one taken may overshoot).
    At least one document is held out and at least one is kept for training (needs two or more)."""
    assert len(lengths) >= 2
    order = np.random.default_rng(seed).permutation(len(lengths))
    chosen: set[int] = set()
    target, chars = val_fraction * sum(lengths), 0
    for i in order[:-1]:
        if chosen and chars >= target:
            break
        chosen.add(int(i))
        chars += lengths[i]
    return chosen


def _single_document_cut(length: int, text: str, val_fraction: float) -> int:
    """For a one-document source: where to cut it (a line start near ``1 - val_fraction``); the tail is val."""
    want = int(round(length * (1 - val_fraction)))
    before, after = text.rfind("\n", 0, want), text.find("\n", want)
    starts = [p + 1 for p in (before, after) if p != -1 and 0 < p + 1 < length]
    cut = min(starts, key=lambda s: abs(s - want)) if starts else want
    if not 0 < cut < length or not text[:cut].strip() or not text[cut:].strip():
        raise DataSourceError(f"the source is a single document of {length} characters, too short to hold out "
                              f"val_fraction={val_fraction} of it; add documents or text")
    return cut


def training_texts(source: str | Path, *, fields: Mapping[str, str] | None, val_fraction: float, seed: int,
                   limit: int | None) -> Iterator[str]:
    """The documents of ``source`` that :func:`prepare_dataset` would put in the training split
    (the text a shared tokenizer may learn from), streamed."""
    src = resolve_source(source, fields)

    def documents() -> Iterator[str]:
        return itertools.islice(src.documents(), limit)

    lengths = [len(d) for d in documents()]
    if not lengths:
        raise DataSourceError(f"source {src.description} has no documents (no non-empty text)")
    if len(lengths) == 1:
        text = next(documents())
        yield text[:_single_document_cut(lengths[0], text, val_fraction)]
        return
    held_out = choose_val_documents(lengths, val_fraction, seed)
    for i, doc in enumerate(documents()):
        if i not in held_out:
            yield doc


def source_name(source: str | Path, fields: Mapping[str, str] | None = None) -> str:
    """The short name of a source (a corpus's name, a file's stem, a directory's name)."""
    prepared = prepared_source(source)
    return _safe_name(prepared.resolve().name) if prepared is not None else resolve_source(source, fields).name


def source_key_parts(source: str | Path, fields: Mapping[str, str] | None = None) -> list[str]:
    """What identifies a source's contents (hashes of its files, or a corpus's name and version)."""
    return resolve_source(source, fields).key_parts


# ----------------------------------------------------------------------------------------- prepare

def _check_args(tokenizer: str, vocab_size: int, val_fraction: float, seed: int, limit: int | None,
                shard_tokens: int) -> None:
    if not isinstance(tokenizer, (str, os.PathLike)) or not str(tokenizer):
        raise ValueError(f"tokenizer={tokenizer!r} must be 'bpe' or the path of a tokenizer.json")
    if str(tokenizer) == "bpe" and (not isinstance(vocab_size, int) or vocab_size < 257):
        raise ValueError(f"vocab_size={vocab_size!r} must be an integer >= 257 (256 bytes plus {EOS})")
    if not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction!r} must be strictly between 0 and 1")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit={limit!r} must be a positive integer (or None for all documents)")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens!r} must be a positive integer")


def dataset_key(source: _Source, tokenizer_spec: str, val_fraction: float, seed: int, limit: int | None) -> str:
    h = hashlib.sha256()
    for part in [f"{FORMAT}-v{FORMAT_VERSION}", *source.key_parts, tokenizer_spec,
                 f"val_fraction={float(val_fraction)!r}", f"seed={seed}", f"limit={limit}"]:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _existing(out_dir: Path, key: str) -> bool:
    """True when ``out_dir`` holds the dataset of ``key``; False when absent or empty; raises otherwise."""
    if not out_dir.exists():
        return False
    if not out_dir.is_dir():
        raise DataSourceError(f"output {out_dir} exists and is not a directory")
    if not any(out_dir.iterdir()):
        return False
    # a damaged index of this format is reported as such, not as "other files"
    found = load_index(out_dir).get("key") if _holds_prepared_index(out_dir) else None
    if found == key:
        return True
    what = f"a different dataset (key {found})" if found else "other files"
    raise DataSourceError(f"output directory {out_dir} already holds {what}, not this one (key {key}); "
                          f"remove it or choose another output directory")


def prepare_dataset(source: str | Path, *, tokenizer: str = "bpe", vocab_size: int = 2048, val_fraction: float = 0.05,
                    out_dir: str | Path | None = None, seed: int = 0, progress: bool = True,
                    limit: int | None = None, shard_tokens: int = SHARD_TOKENS,
                    cache_dir: str | Path | None = None, fields: Mapping[str, str] | None = None,
                    workers: int = 1) -> Path:
    """Tokenise ``source`` into train/val token shards; returns the prepared directory.

    ``source``: a built-in corpus (``shakespeare``, ``bible``), a .txt file (one document, or several
    separated by ``<|endoftext|>``), a .jsonl file (a ``text`` field per line), a directory of them, or
    a directory written by ``prepare_dataset`` (checked and returned as it is, with its own tokenizer).
    ``tokenizer``: ``"bpe"`` trains a byte-level BPE of ``vocab_size`` on the training documents; otherwise
    the path of a tokenizer.json (``vocab_size`` is then the tokenizer's own). ``limit`` keeps the first
    ``limit`` documents. ``shard_tokens`` sets the shard size (layout only, not part of the key).
    ``fields`` names the text column of table files (``{"text": "body"}``); ``workers`` processes
    tokenise (the shards are the same for any number). ``cache_dir`` is plait's cache (default
    ``$PLAIT_CACHE`` or ``~/.cache/plait``): the default output is ``<cache>/datasets/<name>-<key>``
    and trained BPEs are kept in ``<cache>/tokenizers``.
    Same inputs, same directory: a rerun returns it without work. Every problem with the source or
    the data is a :class:`~plait.data.errors.DataError` naming the file.
    """
    return prepare_dataset_ex(source, tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction,
                              out_dir=out_dir, seed=seed, progress=progress, limit=limit,
                              shard_tokens=shard_tokens, cache_dir=cache_dir, fields=fields, workers=workers)[0]


def prepare_dataset_ex(source: str | Path, *, tokenizer: str = "bpe", vocab_size: int = 2048,
                       val_fraction: float = 0.05, out_dir: str | Path | None = None, seed: int = 0,
                       progress: bool = True, limit: int | None = None,
                       shard_tokens: int = SHARD_TOKENS, cache_dir: str | Path | None = None,
                       fields: Mapping[str, str] | None = None, workers: int = 1) -> tuple[Path, bool]:
    """``prepare_dataset`` that also says whether an existing directory was reused: ``(path, reused)``
    (a prepared source counts as reused)."""
    _check_args(tokenizer, vocab_size, val_fraction, seed, limit, shard_tokens)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive integer (processes that tokenise)")
    prepared = prepared_source(source)
    if prepared is not None:
        if fields:
            raise DataSourceError(f"data.fields {dict(fields)} does not apply to {prepared}, a prepared dataset "
                                  f"(its text is already tokenised); remove data.fields")
        if limit is not None:
            raise DataSourceError(f"limit={limit} does not apply to {prepared}, a prepared dataset (its split is "
                                  f"already made); remove the limit")
        return _use_prepared(prepared, tokenizer, out_dir), True
    src = resolve_source(source, fields)
    tok_spec_arg = str(tokenizer)
    if tok_spec_arg == "bpe":
        tok_path, tok_spec = None, f"bpe:{vocab_size}"
    else:
        tok_path = _tokenizer_file(tok_spec_arg)
        tok_spec = f"tokenizer.json:{_hash_file(tok_path)}"
        # the files kept beside it (chat template, special tokens, ...) travel on to the model: keyed too
        companions = {k: v for k, v in model_use_digests(tok_path).items() if k != TOKENIZER_FILE}
        tok_spec += "".join(f";{name}:{digest}" for name, digest in companions.items())
    key = dataset_key(src, tok_spec, val_fraction, seed, limit)
    cache = resolve_cache_dir(cache_dir)
    out = Path(out_dir).expanduser() if out_dir is not None else cache / "datasets" / f"{src.name}-{key}"
    if _existing(out, key):
        return out, True

    def documents() -> Iterator[str]:
        return itertools.islice(src.documents(), limit)

    lengths = [len(d) for d in documents()]
    if not lengths:
        raise DataSourceError(f"source {src.description} has no documents (no non-empty text)")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        index = _write(src, documents, lengths, tmp, key=key, tok_path=tok_path, tok_spec=tok_spec,
                       vocab_size=vocab_size, val_fraction=val_fraction, seed=seed, limit=limit,
                       shard_tokens=shard_tokens, progress=progress, cache=cache, workers=workers)
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if out.exists() and not any(out.iterdir()):
            out.rmdir()
        try:
            os.rename(tmp, out)
        except OSError:
            if _existing(out, key):  # a concurrent run with the same inputs finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return out, True
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, False


def _summary(key_parts: list[str]) -> list[str]:
    """The source's key parts for the index; a directory's per-file hashes are folded into one."""
    if len(key_parts) <= 2:
        return key_parts
    return [key_parts[0], f"{len(key_parts) - 1} files",
            hashlib.sha256("\0".join(key_parts[1:]).encode()).hexdigest()]


def _write(src: _Source, documents: Callable[[], Iterator[str]], lengths: list[int], tmp: Path, *, key: str,
           tok_path: Path | None, tok_spec: str, vocab_size: int, val_fraction: float, seed: int,
           limit: int | None, shard_tokens: int, progress: bool, cache: Path, workers: int) -> dict:
    """Tokenises every document into ``tmp``; returns the index (written by the caller)."""
    if len(lengths) == 1:
        val_docs: set[int] = set()
        cut = _single_document_cut(lengths[0], next(documents()), val_fraction)
    else:
        val_docs, cut = choose_val_documents(lengths, val_fraction, seed), None

    def split_documents() -> Iterator[tuple[bool, str]]:
        n = 0
        for i, doc in enumerate(documents()):
            n += 1
            if cut is not None:
                yield False, doc[:cut]
                yield True, doc[cut:]
            else:
                yield i in val_docs, doc
        if n != len(lengths):
            raise DataSourceError(f"source {src.description} changed while it was being read "
                                  f"({len(lengths)} documents, then {n}); run again")

    if tok_path is None:
        tok = train_bpe((text for is_val, text in split_documents() if not is_val), vocab_size,
                        cache_key=f"dataset-{key}", cache_root=cache)
        tok.save(str(tmp / TOKENIZER_FILE))
    else:
        tok = load_tokenizer_file(tok_path)
        copy_model_use_files(tmp, tok_path)  # tokenizer.json and the files beside it that describe the model's use
    eos_token, eos_id = find_eos(tok)
    vocab = tokenizer_vocab_size(tok)
    dtype = token_dtype(vocab)
    writers = {False: ShardWriter(tmp, "train", dtype, shard_tokens),
               True: ShardWriter(tmp, "val", dtype, shard_tokens)}

    def batches() -> Iterator[list[tuple[bool, str]]]:
        batch: list[tuple[bool, str]] = []
        chars = 0
        for is_val, text in split_documents():
            batch.append((is_val, text))
            chars += len(text)
            if len(batch) >= _ENCODE_BATCH_DOCS or chars >= _ENCODE_BATCH_CHARS:
                yield batch
                batch, chars = [], 0
        if batch:
            yield batch

    bar = tqdm(unit="tok", unit_scale=True, desc=f"tokenising {src.name}", disable=not progress, leave=False)
    documents_done = 0
    for encoded in encode_in_order(batches(), tok=tok, tokenizer_file=tmp / TOKENIZER_FILE, eos_id=eos_id,
                                   dtype=dtype, workers=workers):
        for is_val, ids, n in ((False, encoded.train, encoded.train_documents),
                               (True, encoded.val, encoded.val_documents)):
            if n:
                writers[is_val].add(ids, documents=n)
        documents_done += encoded.train_documents + encoded.val_documents
        bar.update(encoded.tokens)
        bar.set_postfix_str(f"{documents_done}/{len(lengths) if cut is None else 2} docs", refresh=False)
    bar.close()
    splits = {"train": writers[False].close(), "val": writers[True].close()}

    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "key": key,
        "inputs": {"source": src.description, "source_key": _summary(src.key_parts), "tokenizer": tok_spec,
                   "val_fraction": float(val_fraction), "seed": seed, "limit": limit, "plait": plait_version},
        "dtype": dtype.name,
        "vocab_size": vocab,
        "eos_id": eos_id,
        "eos_token": eos_token,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": file_sha256(tmp / TOKENIZER_FILE),  # the identity: two tokenizers of one size differ
        "shard_tokens": shard_tokens,
        "train_tokens": splits["train"]["tokens"],
        "val_tokens": splits["val"]["tokens"],
        "documents": len(lengths),
        "single_document_cut": cut,
        "splits": splits,
    }
