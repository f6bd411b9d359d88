"""Dataset files as users keep them: Parquet, Arrow (``save_to_disk`` directories), CSV and JSON,
named one by one, as a directory, or as a glob, with columns of their own names.

Every reader streams: Parquet and Arrow are read in record batches of :data:`BATCH_ROWS` rows
(Arrow files are memory-mapped), CSV through pyarrow's streaming reader, JSON Lines line by
line, so a corpus larger than memory is tokenised without being loaded whole. (A ``.json`` file
holding one JSON array is the exception: it is parsed whole.)

``fields`` maps plait's names for the columns it reads (:data:`FIELDS`) to the file's own, e.g.
``{"text": "body"}``: the reader renames them, so every row parser downstream sees plait's names.
Problems that a file's schema already shows (a missing column, a text column of numbers) are one
:class:`DataFileError` naming the file, the column and the columns that exist, raised before any
row is read; a row-level problem names ``FILE:row N`` (``FILE:LINE`` for JSON Lines).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from plait.data.errors import DataError, RowError

#: plait's names for the columns it reads; ``data.fields`` maps any of them to a file's own column
FIELDS = ("text", "messages", "prompt", "completion", "chosen", "rejected", "answer")
#: file suffixes read as tables (and JSON), besides plain ``.txt`` text
TABLE_SUFFIXES = (".parquet", ".arrow", ".csv", ".json", ".jsonl")
#: rows per record batch when streaming a Parquet or Arrow file
BATCH_ROWS = 1024
#: the columns each ``data.format`` needs: any one of the alternatives, all of its columns
NEEDED: dict[str, tuple[tuple[str, ...], ...]] = {
    "text": (("text",),),
    "sft": (("messages",), ("prompt", "completion")),
    "preference": (("prompt", "chosen", "rejected"), ("messages", "chosen", "rejected")),
    "prompts": (("prompt", "answer"), ("messages", "answer")),
}
#: the arrow types that hold text
_STRING_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view, pa.types.is_null)


class DataFileError(DataError):
    """A dataset file that cannot be read as asked: no such file, a glob without matches, a column
    that is missing or of the wrong type."""


def is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``datasets.Dataset.save_to_disk`` (its ``state.json`` lists the Arrow files)."""
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _saved_dataset_files(path: Path) -> list[Path]:
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataFileError(f"{path / 'state.json'}: not a readable save_to_disk state ({exc}); save the dataset "
                            f"again with datasets' save_to_disk") from None
    files = [path / name for name in names]
    for f in files:
        if not f.is_file():
            raise DataFileError(f"{path}: {f.name} is listed in state.json but missing; save the dataset again")
    return files


def expand_source(spec: str, suffixes: Sequence[str] = TABLE_SUFFIXES) -> list[Path] | None:
    """The files a ``data.source`` names when it is a glob, a ``save_to_disk`` directory, a
    ``DatasetDict`` directory (refused: name one split) or one file with a suffix in ``suffixes``;
    None when it is none of these (a directory of files, a corpus name: the caller decides)."""
    if is_glob(spec):
        matches = sorted(Path(p) for p in glob.glob(str(Path(spec).expanduser()), recursive=True))
        files = [p for p in matches if p.is_file() and p.suffix.lower() in suffixes]
        files += [f for p in matches if is_saved_dataset(p) for f in _saved_dataset_files(p)]
        if not files:
            what = f"{len(matches)} paths, none of them a {'/'.join(suffixes)} file" if matches else "nothing"
            raise DataFileError(f"data.source {spec!r}: the pattern matches {what}; check the pattern (a "
                                f"recursive one needs '**')")
        return sorted(set(files))
    path = Path(spec).expanduser()
    if is_saved_dataset(path):
        return _saved_dataset_files(path)
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if is_saved_dataset(p))
        raise DataFileError(f"data.source {spec!r} is a DatasetDict with the splits {splits}; name one of them, "
                            f"e.g. {path / (splits[0] if splits else 'train')} (plait makes its own validation split)")
    if path.is_file() and path.suffix.lower() in suffixes:
        return [path]
    return None


def row_source_files(spec: str | os.PathLike, what: str = "data.source") -> list[Path]:
    """The files of a row source: a table or JSON file, a ``save_to_disk`` directory or a glob (a
    plain directory is refused: it may hold rows of several kinds)."""
    files = expand_source(str(spec))
    if files is not None:
        return files
    path = Path(spec).expanduser()
    if path.is_dir():  # a directory may hold rows of several kinds (train, held out, preference): name them
        kinds = sorted({p.suffix.lower() for p in path.rglob("*") if p.suffix.lower() in TABLE_SUFFIXES})
        example = f"{path}/*{kinds[0]}" if kinds else f"{path}/*.jsonl"
        raise DataFileError(f"{what} {str(spec)!r} is a directory; name its row files with a glob (e.g. "
                            f"{example}) or give one file")
    if path.is_file():
        raise DataFileError(f"{what} {str(spec)!r}: suffix {path.suffix!r} is not a row file; give a "
                            f"{', '.join(TABLE_SUFFIXES)} file, a save_to_disk directory or a glob")
    raise DataFileError(f"{what} {str(spec)!r}: no such file or directory; give a {', '.join(TABLE_SUFFIXES)} "
                        f"file, a save_to_disk directory or a glob")


def files_digest(files: Sequence[Path], root: Path | None = None) -> str:
    """SHA-256 over each file's name (relative to ``root`` when given) and contents, in order."""
    digest = hashlib.sha256()
    for f in files:
        digest.update((f.relative_to(root).as_posix() if root else f.name).encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------ schemas

def _arrow_reader(path: Path) -> pa.RecordBatchReader:
    """An Arrow file as a stream of record batches (``save_to_disk`` writes the stream format; the
    file format is read too), memory-mapped."""
    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            file_reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as exc:
            raise DataFileError(f"{path}: not an Arrow file ({exc}); write it with pyarrow or datasets") from None
        return pa.RecordBatchReader.from_batches(
            file_reader.schema, (file_reader.get_batch(i) for i in range(file_reader.num_record_batches)))


def table_schema(path: Path) -> pa.Schema | None:
    """The schema of a Parquet, Arrow or CSV file; None for JSON (read row by row)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return pq.ParquetFile(path).schema_arrow
        if suffix == ".arrow":
            return _arrow_reader(path).schema
        if suffix == ".csv":
            return pa_csv.open_csv(path).schema
    except DataFileError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise DataFileError(f"{path}: cannot be read as {suffix[1:]} ({' '.join(str(exc).split())[:200]})") from None
    return None


def _column_for(field: str, fields: Mapping[str, str]) -> str:
    return fields.get(field, field)


def check_columns(path: Path, data_format: str, fields: Mapping[str, str]) -> list[str] | None:
    """The file columns ``data_format`` reads from ``path`` (None for JSON, checked per row); a
    missing column, or a ``text`` column that does not hold strings, is a :class:`DataFileError`."""
    schema = table_schema(path)
    if schema is None:
        return None
    names = list(schema.names)
    options = NEEDED[data_format]
    for option in options:
        columns = [_column_for(f, fields) for f in option]
        if all(c in names for c in columns):
            if data_format == "text" and path.suffix.lower() != ".csv":  # CSV holds text only
                kind = schema.field(columns[0]).type
                if not any(is_type(kind) for is_type in _STRING_TYPES):
                    raise DataFileError(f"{path}: column {columns[0]!r} holds {kind}, not text; name the text "
                                        f"column with data.fields: {{text: COLUMN}}")
            optional = [_column_for(f, fields) for f in FIELDS if f not in option]
            return columns + [c for c in optional if c in names and c not in columns]
    raise DataFileError(_missing_message(path, data_format, options, fields, names))


def _missing_message(path: Path, data_format: str, options: tuple[tuple[str, ...], ...],
                     fields: Mapping[str, str], names: list[str]) -> str:
    first = options[0]
    absent = [f for f in first if _column_for(f, fields) not in names]
    named = ", ".join(f"{_column_for(f, fields)!r}" + (f" (data.fields.{f})" if f in fields else "") for f in absent)
    alternatives = " or ".join("+".join(o) for o in options)
    hint = ""
    for other, other_options in NEEDED.items():
        if other != data_format and any(all(c in names for c in o) for o in other_options):
            hint = f"; its columns are {other} rows: set data.format: {other}"
            break
    if not hint:
        hint = (f"; map plait's names to yours with data.fields, e.g. data.fields: {{{first[0]}: COLUMN}}"
                f" (data.format {data_format!r} reads {alternatives})")
    return f"{path}: no column {named}; the file has columns {names[:12]}{hint}"


# -------------------------------------------------------------------------------------------- rows

def json_lines(path: Path) -> Iterator[tuple[str, object]]:
    """``(file:line, JSON value)`` per non-blank line; RowError for bytes or text that do not parse."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, RowError(f"{where}: byte {exc.start} of the line ({raw[exc.start:exc.start + 1]!r}) "
                                      f"is not UTF-8; re-encode the file as UTF-8", "bad_utf8")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                yield where, RowError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); write one JSON "
                                      f"object per line", "bad_json")


def _renamed(record: dict, fields: Mapping[str, str]) -> dict:
    """``record`` under plait's names: each mapped column is read as its field; nulls are absent."""
    if not fields:
        return {k: v for k, v in record.items() if v is not None}
    mapped = set(fields.values())
    out = {k: v for k, v in record.items() if k not in fields and k not in mapped and v is not None}
    for field, column in fields.items():
        if record.get(column) is not None:
            out[field] = record[column]
    return out


def _batches(path: Path, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            # no pre-buffering: pyarrow would otherwise read every row group's column chunks ahead
            reader = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
            yield from reader.iter_batches(batch_size=BATCH_ROWS, columns=columns)
        elif suffix == ".arrow":
            for batch in _arrow_reader(path):
                yield batch.select(columns) if columns is not None else batch
        else:  # csv: every read column as text (a CSV has no types; inference would make "42" a number)
            types = {c: pa.string() for c in columns or []}
            reader = pa_csv.open_csv(path, convert_options=pa_csv.ConvertOptions(column_types=types,
                                                                                 include_columns=columns))
            yield from reader
    except (pa.ArrowException, OSError) as exc:
        raise DataFileError(f"{path}: cannot be read ({' '.join(str(exc).split())[:200]})") from None


def _json_records(path: Path) -> Iterator[tuple[str, object]]:
    """``(where, value)`` of a JSON file: JSON Lines, or one top-level array (parsed whole)."""
    with path.open("rb") as fh:
        head = fh.read(4096).lstrip()
    if path.suffix.lower() == ".json" and head.startswith(b"["):
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            yield f"{path}", RowError(f"{path}: not a JSON array ({exc}); write a JSON array of objects or one "
                                      f"object per line", "bad_json")
            return
        for i, value in enumerate(values, 1):
            yield f"{path}:item {i}", value
        return
    yield from json_lines(path)


def read_records(path: Path, data_format: str, fields: Mapping[str, str]) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for every row of ``path`` under plait's names (``where`` is ``FILE:row N``,
    ``FILE:LINE`` for JSON Lines); a JSON line that does not parse is yielded as a ``RowError``
    value for the caller to raise or count. Columns are checked first (:func:`check_columns`)."""
    columns = check_columns(path, data_format, fields)
    if columns is None:
        for where, value in _json_records(path):
            yield where, _renamed(value, fields) if isinstance(value, dict) else value
        return
    row = 0
    for batch in _batches(path, columns):
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", _renamed(record, fields)


def text_column_values(path: Path, fields: Mapping[str, str]) -> Iterator[tuple[str, object]]:
    """``(where, value)`` of the text column of a table file, one batch column at a time (only the
    text column is read)."""
    columns = check_columns(path, "text", fields)
    assert columns is not None
    row = 0
    for batch in _batches(path, columns[:1]):
        for value in batch.column(0).to_pylist():
            row += 1
            yield f"{path}:row {row}", value


def check_row_source(spec: str | os.PathLike, data_format: str, fields: Mapping[str, str],
                     what: str = "data.source") -> None:
    """Before launch: the files of a row source exist, tables hold the columns ``data_format``
    reads, and the first row of each JSON file parses and holds them (its other rows are checked
    when the rows are prepared); a problem is a :class:`DataError`."""
    for path in row_source_files(spec, what):
        if check_columns(path, data_format, fields) is not None:
            continue
        for where, value in read_records(path, data_format, fields):
            if isinstance(value, RowError):
                raise value
            keys = sorted(value) if isinstance(value, dict) else []
            if not any(all(f in keys for f in option) for option in NEEDED[data_format]):
                found = f"keys {keys[:8]}" if isinstance(value, dict) else f"a JSON {type(value).__name__}"
                needed = " or ".join("+".join(o) for o in NEEDED[data_format])
                raise DataFileError(f"{where}: the first row holds {found}; data.format {data_format!r} reads "
                                    f"{needed} (map other names with data.fields)")
            break
