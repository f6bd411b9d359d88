"""The data: ``data.format`` against ``train.objective``, the source and tokenizer files a recipe
names (readable, of a usable kind, before launch), and the vocabulary against the model's."""

from __future__ import annotations

import codecs
from pathlib import Path

from plait.config.rules.checker import Checker
from plait.config.schema import PREFERENCE_OBJECTIVES
from plait.data.corpora import CORPORA
from plait.data.dataset_files import check_columns, check_row_source, expand_source
from plait.data.errors import DataError
from plait.data.prepare import SOURCE_SUFFIXES, prepared_source
from plait.data.prompt_prepare import prepared_directory
from plait.data.token_shards import TOKENIZER_FILE
from plait.data.tokenizer import find_eos, load_tokenizer_file, tokenizer_vocab_size
from plait.models.decoder.config import DecoderConfig

#: the objective each data format trains with (preference: one of several)
FORMAT_OBJECTIVES: dict[str, tuple[str, ...]] = {"text": ("lm",), "sft": ("sft",), "preference": PREFERENCE_OBJECTIVES,
                                                  "prompts": ("grpo",)}


def check_fine_tuning(c: Checker) -> None:
    """``data.format`` and ``train.objective`` go together; ``sft``, ``preference`` and ``prompts``
    rows come from one .jsonl file (or a directory prepared from one) rendered with the model's
    own tokenizer and chat template."""
    d, t, check_paths = c.r.data, c.r.train, c.check_paths
    if not c.ok("data.format", "train.objective"):
        return
    wanted = FORMAT_OBJECTIVES[d.format]
    if t.objective not in wanted:
        choice = wanted[0] if len(wanted) == 1 else " | ".join(wanted)
        fix = (f"set train.objective={choice}" if len(wanted) == 1
               else f"set train.objective to one of {choice}")
        owner = next(f for f, objectives in FORMAT_OBJECTIVES.items() if t.objective in objectives)
        c.add("train.objective", t.objective, f"data.format {d.format!r} trains with objective {choice}; {fix} "
                                              f"(or data.format={owner} for objective {t.objective!r})")
    if d.format == "text":
        return
    if c.ok("data.tokenizer") and d.tokenizer == "bpe" and not (check_paths and prepared_directory(d.format, d.source)):
        c.add("data.tokenizer", "bpe", f"data.format {d.format!r} needs the model's tokenizer.json (its chat "
                                       f"template renders the rows), e.g. '<model.hf_path>/tokenizer.json'")
    if (check_paths and c.ok("data.source") and d.sources is None  # a mixture of rows is refused by its own rule
            and prepared_directory(d.format, d.source) is None):
        try:  # the files exist and hold the columns the format reads (JSON: its first row)
            check_row_source(d.source, d.format, {str(k): v for k, v in d.fields.items()})
        except DataError as e:
            c.add("data.source", d.source, f"data.format {d.format!r}: {' '.join(str(e).split())}")


def check_data(c: Checker) -> None:
    """The source and tokenizer files, and the vocabulary (``data.format`` and the objective:
    :func:`check_fine_tuning`)."""
    d, m, arch, check_paths = c.r.data, c.r.model, c.arch, c.check_paths
    if d.format != "text":
        if check_paths and c.ok("data.tokenizer") and d.tokenizer != "bpe":
            tokens = _check_tokenizer_file(c)
            if tokens is not None and c.ok("model.hf_path"):
                _check_vocab_fits(c, arch, tokens)
        return
    if d.sources is not None:
        _check_mixture(c)
    elif check_paths and c.ok("data.source"):
        _check_source(c)
    if check_paths and c.ok("data.tokenizer") and d.tokenizer != "bpe":
        tokens = _check_tokenizer_file(c)
        if tokens is not None and c.ok("model.hf_path"):
            _check_vocab_fits(c, arch, tokens)
    if c.ok("data.tokenizer", "model.hf_path") and m.hf_path is not None and d.tokenizer == "bpe":
        c.add("data.tokenizer", "bpe", f"a model initialised from model.hf_path needs its own tokenizer; "
                                       f"set data.tokenizer to '{Path(m.hf_path) / 'tokenizer.json'}'")
    # a prepared source carries its own tokenizer; its size is checked against the model before launch
    if (c.ok("model.vocab_size", "data.vocab_size", "data.tokenizer") and m.hf_path is None
            and d.tokenizer == "bpe" and m.vocab_size is not None and m.vocab_size < d.vocab_size
            and not (c.ok("data.source") and prepared_source(d.source) is not None)):
        c.add("model.vocab_size", m.vocab_size, f"must be >= data.vocab_size={d.vocab_size} (the BPE's size), "
                                                f"or null to use the tokenizer's size")


def _text_sniff(path: Path, size: int = 1 << 16) -> str | None:
    """Why the start of ``path`` is not UTF-8 text (``None`` when it is): a binary file renamed
    ``.txt`` would otherwise fail, or train on garbage, only after launch."""
    try:
        with path.open("rb") as f:
            head = f.read(size)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if b"\x00" in head:
        return "holds NUL bytes (a binary file, not text)"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte {e.start} is invalid)"
    return None


def _check_mixture(c: Checker) -> None:
    """``data.sources`` replaces ``data.source`` and ``data.fields`` (each source has its own), and
    each of its sources is checked as ``data.source`` would be."""
    d = c.r.data
    default = type(d)()
    if d.source != default.source:
        c.add("data.source", d.source, "is given together with data.sources; keep one: data.source for one corpus, "
                                       "data.sources for a mixture")
    if d.fields:
        c.add("data.fields", d.fields, "does not apply to data.sources; give each source its own "
                                       "data.sources[i].fields")
    if c.check_paths:
        for i, entry in enumerate(d.sources or []):
            _check_source(c, entry.source, f"data.sources.{i}.source", {str(k): v for k, v in entry.fields.items()})


def _check_source(c: Checker, source: str | None = None, field: str = "data.source",
                  fields: dict[str, str] | None = None) -> None:
    """``data.source``: a built-in corpus, an existing directory, a glob, or a readable text or
    table file whose columns hold the text (the schema of Parquet, Arrow and CSV files is read)."""
    if source is None:
        source = c.r.data.source
        fields = {str(k): v for k, v in c.r.data.fields.items()}
    if source in CORPORA:
        return
    try:
        listed = expand_source(source, SOURCE_SUFFIXES)
        for f in listed or []:
            if f.suffix.lower() in (".parquet", ".arrow", ".csv"):
                check_columns(f, "text", fields or {})
    except DataError as e:
        c.add(field, source, " ".join(str(e).split()))
        return
    if listed is not None and len(listed) != 1:
        return
    path = listed[0] if listed else Path(source).expanduser()
    if not path.exists():
        c.add(field, source, f"not a built-in corpus ({', '.join(CORPORA)}) and no such file, directory or glob")
    elif path.is_file():
        kinds = " or ".join(SOURCE_SUFFIXES)
        if path.suffix.lower() not in SOURCE_SUFFIXES:
            what = f"a {path.suffix!r} file" if path.suffix else "a file without a suffix"
            c.add(field, source, f"is {what}; a source file must be {kinds} (plain text, a 'text' field per JSON "
                                 f"row, or a text column): convert it, or give a directory of such files")
        elif path.suffix.lower() in (".txt", ".jsonl", ".json") and (why := _text_sniff(path)) is not None:
            c.add(field, source, f"{why}; a {path.suffix} source must be UTF-8 text")


def _check_tokenizer_file(c: Checker) -> int | None:
    """``data.tokenizer`` as a file: it must load as a tokenizer and have an end-of-text token
    (what data preparation needs). Returns its vocabulary size (``None`` when it is unusable)."""
    spec = c.r.data.tokenizer
    path = Path(spec).expanduser()
    if path.is_dir():
        hint = f"; did you mean '{path / TOKENIZER_FILE}'?" if (path / TOKENIZER_FILE).is_file() else ""
        c.add("data.tokenizer", spec, f"must be 'bpe' or a tokenizer.json file, not a directory{hint}")
        return None
    if not path.is_file():
        c.add("data.tokenizer", spec, "must be 'bpe' or the path of an existing tokenizer.json file")
        return None
    try:
        tokenizer = load_tokenizer_file(path)
    except ValueError as e:
        reason = str(e).partition("cannot be loaded ")[2] or str(e)
        c.add("data.tokenizer", spec, f"is not a tokenizer file, tokenizers cannot load it {reason[:160]}; give "
                                      f"a Hugging Face tokenizer.json, or 'bpe' to train one on the source")
        return None
    try:
        find_eos(tokenizer)
    except ValueError as e:
        c.add("data.tokenizer", spec, f"{e}: documents could not be separated; use a tokenizer that has one, "
                                      f"or 'bpe'")
        return None
    return tokenizer_vocab_size(tokenizer)


def _check_vocab_fits(c: Checker, arch: DecoderConfig | None, tokens: int) -> None:
    """The embedding must have a row for every id the tokenizer file can produce."""
    d, m = c.r.data, c.r.model
    if m.hf_path is not None:
        if arch is not None and tokens > arch.vocab_size:
            c.add("data.tokenizer", d.tokenizer, f"has {tokens} tokens but model.hf_path's config.json has "
                                                 f"vocab_size={arch.vocab_size}; use the checkpoint's own tokenizer")
    elif c.ok("model.vocab_size") and m.vocab_size is not None and m.vocab_size < tokens:
        c.add("model.vocab_size", m.vocab_size, f"must be >= {tokens}, the size of data.tokenizer "
                                                f"'{d.tokenizer}', or null to use the tokenizer's size")
