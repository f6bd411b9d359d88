"""Fine-tuning data on disk: JSONL rows -> chat-rendered, masked, (packed) rows of ``seq_len``.

``prepare_rows`` reads an SFT or preference JSONL file (:mod:`plait.data.sft_rows`), splits the
*rows* into train and validation (held-out rows are never seen in training, whole), renders and
tokenises them with the tokenizer's chat template and marks the assistant tokens
(:mod:`plait.data.sft_tokenize`), packs them (:mod:`plait.data.packing`) and writes, per split,
``[rows, seq_len]`` arrays of input ids, labels, positions and segments plus the number of
target tokens of each row (and, for preference rows, the number of pairs and of chosen-response
target tokens of each row). :class:`RowDataset` serves them to the loader.

The directory is keyed by everything that changes its content (file hash, format, sequence length,
packing, truncation, train_on_prompt, split) and by everything of the tokenizer: the hash of each
file that travels with a model directory (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, ``special_tokens_map.json``, ``generation_config.json``, see
:mod:`plait.data.tokenizer_files`), the chat template's text and its BOS/EOS tokens. It keeps those
files (they travel on to the trained model) and records the tokenizer's identity (the sha256 of
``tokenizer.json``), so rows are never used with another tokenizer of the same size
(:func:`check_rows_tokenizer`). It is written under a temporary name and renamed into place, so a
rerun with the same inputs reuses it and a killed run leaves no half directory behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tokenizers import Tokenizer

from plait.data.batch import PairCounts, TokenBatch
from plait.data.chat_template import ChatTemplate, load_chat_template
from plait.data.dataset_files import files_digest, row_source_files
from plait.data.errors import DataError
from plait.data.packing import IGNORE_INDEX, PackedRows, pack
from plait.data.reference_table import batch_reference, pair_offsets
from plait.data.sft_rows import PreferenceRow, SFTRow, describe_skipped, read_preference_rows, read_sft_rows
from plait.data.sft_tokenize import describe_counts, tokenize_preference, tokenize_sft
from plait.data.token_shards import TOKENIZER_FILE
from plait.data.tokenizer import cache_dir as resolve_cache_dir
from plait.data.tokenizer import find_eos, load_tokenizer_file, tokenizer_vocab_size
from plait.data.tokenizer_files import copy_model_use_files, model_use_digests, tokenizer_sha256

#: ``index.json`` ``format`` of a prepared fine-tuning directory
ROWS_FORMAT = "plait-rows-v1"
INDEX_FILE = "index.json"
FIELDS = ("input_ids", "labels", "position_ids", "segment_ids")
RowFormat = Literal["sft", "preference"]


@dataclass(frozen=True)
class RowsSettings:
    """What shapes the prepared rows (all of it is part of the directory's key)."""

    kind: RowFormat
    seq_len: int
    packing: bool = True
    truncation: str = "drop"
    train_on_prompt: bool = False
    skip_bad_rows: bool = False
    val_fraction: float = 0.05
    seed: int = 0
    fields: tuple[tuple[str, str], ...] = ()  # data.fields: plait's column names -> the files'


@dataclass(frozen=True)
class RowsReport:
    """What preparation did, for the one-line report of ``plait data prepare`` and ``plait train``."""

    directory: Path
    reused: bool
    rows: dict[str, int]
    efficiency: dict[str, float]
    counts: dict[str, int]
    skipped: dict[str, int]

    def describe(self) -> str:
        split = ", ".join(f"{name} {n} rows ({self.efficiency[name]:.0%} real tokens)" for name, n in self.rows.items())
        return (f"{split}; {describe_counts(Counter(self.counts))}; {describe_skipped(Counter(self.skipped))}"
                f"{' (reused)' if self.reused else ''}")


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _key(sources: list[Path], tokenizer: Path, settings: RowsSettings, template: ChatTemplate) -> str:
    """Everything the rows depend on: the source files, every tokenizer file that travels with the model
    (their hashes, so a new chat_template.jinja or special token is a new key), the chat template's
    text and special tokens as rendered, and the settings (the column map only when one is given,
    so the keys of rows prepared before it existed stay the same)."""
    source = _hash_file(sources[0]) if len(sources) == 1 else files_digest(sources)[:16]
    shaping = {k: v for k, v in settings.__dict__.items() if k != "fields" or v}
    text = json.dumps({"source": source, "tokenizer_files": model_use_digests(tokenizer),
                       "template": template.text, "bos_token": template.bos_token, "eos_token": template.eos_token,
                       **shaping, "format": ROWS_FORMAT}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def split_rows(rows: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """Rows shuffled once by ``seed`` then cut: the validation rows are whole conversations."""
    if len(rows) < 2:
        raise DataError(f"{len(rows)} usable row(s): at least 2 are needed (one for training, one held out)")
    order = np.random.default_rng(seed).permutation(len(rows))
    n_val = min(len(rows) - 1, max(1, round(len(rows) * val_fraction)))
    val = sorted(order[:n_val].tolist())
    train = sorted(order[n_val:].tolist())
    return [rows[i] for i in train], [rows[i] for i in val]


def _targets(labels: np.ndarray) -> np.ndarray:
    """Target tokens per row: positions ``t`` whose next label counts (the loss shifts inside)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(axis=1).astype(np.int64)


def _pairs(segment_ids: np.ndarray) -> np.ndarray:
    """Preference pairs per row: segments ``2k`` and ``2k + 1`` are pair ``k`` of the row."""
    return ((segment_ids.max(axis=1, initial=-1) + 1) // 2).astype(np.int64)


def _chosen_targets(labels: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """Target tokens of the chosen responses per row (even segments), for the SFT term's normaliser."""
    scored = (labels[:, 1:] != IGNORE_INDEX) & (segment_ids[:, 1:] >= 0) & (segment_ids[:, 1:] % 2 == 0)
    return scored.sum(axis=1).astype(np.int64)


def _write_split(out: Path, split: str, rows: PackedRows, kind: RowFormat) -> None:
    for name in FIELDS:
        np.save(out / f"{split}_{name}.npy", getattr(rows, name).astype(np.int32))
    np.save(out / f"{split}_targets.npy", _targets(rows.labels))
    if kind == "preference":  # per-row counts: every rank knows a global batch's pairs without communication
        np.save(out / f"{split}_pairs.npy", _pairs(rows.segment_ids))
        np.save(out / f"{split}_chosen_targets.npy", _chosen_targets(rows.labels, rows.segment_ids))


def _read_rows(sources: list[Path],
               settings: RowsSettings) -> tuple[list[SFTRow] | list[PreferenceRow], Counter[str]]:
    fields = dict(settings.fields)
    if settings.kind == "sft":
        return read_sft_rows(sources, skip_bad_rows=settings.skip_bad_rows, fields=fields)
    return read_preference_rows(sources, skip_bad_rows=settings.skip_bad_rows, fields=fields)


def read_index(directory: Path, data_format: str | None = None) -> dict | None:
    """The ``index.json`` of ``directory`` when its ``format`` is ``data_format`` (``None``: any),
    else None (absent, unreadable, another kind of prepared directory)."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return None
    try:
        found = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict):
        return None
    return found if data_format is None or found.get("format") == data_format else None


def rows_index(directory: Path) -> dict | None:
    """The ``index.json`` of a prepared fine-tuning directory, else None (absent, unreadable, another kind)."""
    return read_index(directory, ROWS_FORMAT)


def _existing(out: Path, key: str) -> dict | None:
    found = rows_index(out)
    return found if found is not None and found.get("key") == key else None


def _report(out: Path, index: dict, reused: bool) -> RowsReport:
    return RowsReport(directory=out, reused=reused, rows=index["rows"], efficiency=index["efficiency"],
                      counts=index["counts"], skipped=index["skipped"])


def prepare_rows(source: str | os.PathLike, tokenizer: str | os.PathLike, settings: RowsSettings, *,
                 out_dir: str | os.PathLike | None = None,
                 cache_dir: str | os.PathLike | None = None) -> RowsReport:
    """Prepare (or reuse) the rows of ``source`` (a JSONL file); see the module doc. ``tokenizer``
    is a ``tokenizer.json`` (its directory's ``tokenizer_config.json`` gives the chat template)."""
    files = row_source_files(source)
    src = files[0] if len(files) == 1 else Path(str(source))
    tok_path = Path(tokenizer).expanduser()
    if not tok_path.is_file():
        raise DataError(f"data.tokenizer {str(tokenizer)!r}: data.format {settings.kind!r} needs the model's "
                        f"tokenizer.json (its chat template renders the rows); no such file")
    template = load_chat_template(tok_path)  # the text and special tokens of tokenizer_config.json: for the key
    key = _key(files, tok_path, settings, template)
    cache = resolve_cache_dir(cache_dir)
    default = cache / "datasets" / f"{_safe_stem(src)}-{settings.kind}-{key}"
    out = Path(out_dir).expanduser() if out_dir is not None else default
    found = _existing(out, key)
    if found is not None:
        return _report(out, found, reused=True)
    stale = out.exists() and out_dir is None and rows_directory(out) is not None  # ours, of an older index
    if out.exists() and not stale and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"data output {out} exists and is not this data's prepared directory; plait does not "
                        f"replace what it did not write: give an empty or new directory")
    tok = load_tokenizer_file(tok_path)
    template = load_chat_template(tok_path, tok)
    rows, skipped = _read_rows(files, settings)
    train_rows, val_rows = split_rows(list(rows), settings.val_fraction, settings.seed)
    pad_id = 0
    counts: Counter[str] = Counter()
    packed: dict[str, PackedRows] = {}
    for split, part in (("train", train_rows), ("val", val_rows)):
        if settings.kind == "sft":
            units, c = tokenize_sft(part, tok, template, seq_len=settings.seq_len, truncation=settings.truncation,
                                    train_on_prompt=settings.train_on_prompt)
            packed[split] = pack(units, settings.seq_len, pad_id=pad_id, packed=settings.packing)
        else:
            pairs, c = tokenize_preference(part, tok, template, seq_len=settings.seq_len,
                                           truncation=settings.truncation)
            packed[split] = pack(pairs, settings.seq_len, pad_id=pad_id, packed=settings.packing)
        counts.update({f"{split}_{k}": v for k, v in c.items()})
    index = {"format": ROWS_FORMAT, "key": key, "kind": settings.kind, "seq_len": settings.seq_len,
             "packing": settings.packing, "truncation": settings.truncation,
             "train_on_prompt": settings.train_on_prompt, "skip_bad_rows": settings.skip_bad_rows,
             "val_fraction": settings.val_fraction,
             "source": str(src), "template": template.source,
             "template_sha256": hashlib.sha256(template.text.encode()).hexdigest(),
             "tokenizer_sha256": tokenizer_sha256(tok_path), "tokenizer_source": str(tok_path),
             "vocab_size": tokenizer_vocab_size(tok),
             "rows": {s: p.num_rows for s, p in packed.items()},
             "efficiency": {s: round(p.efficiency, 4) for s, p in packed.items()},
             "counts": dict(counts), "skipped": dict(skipped)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for split, rows_of_split in packed.items():
            _write_split(tmp, split, rows_of_split, settings.kind)
        copy_model_use_files(tmp, tok_path)  # they travel on with the trained model
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1), encoding="utf-8")
        os.chmod(tmp, 0o777 & ~_umask())
        if stale:
            shutil.rmtree(out)
        elif out.is_dir():
            out.rmdir()  # empty
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _report(out, index, reused=False)


def _safe_stem(path: Path) -> str:
    """A directory-name stem of a source (a glob's characters replaced)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem).strip("._") or "rows"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def rows_directory(path: str | os.PathLike) -> Path | None:
    """``path`` as a prepared fine-tuning directory, else None."""
    p = Path(path).expanduser()
    return p if rows_index(p) is not None else None


class TokenizerMismatchError(DataError):
    """Prepared rows used with a tokenizer other than the one they were made with."""


def check_rows_tokenizer(directory: str | os.PathLike, tokenizer: str | os.PathLike | None) -> None:
    """Refuse rows (or prompts) of ``directory`` that are not made with ``tokenizer`` (a ``tokenizer.json`` or a
    directory holding one; ``None`` or ``"bpe"``: the rows' own tokenizer is used, nothing to compare).

    The identity is the sha256 of ``tokenizer.json``, so another tokenizer of the same vocabulary
    size is told apart; the directory's own ``tokenizer.json`` must still be the one its index
    records (directories prepared before the identity was recorded are compared by their file)."""
    d = Path(directory)
    index = read_index(d) or {}  # prepared rows or prompts: both record their tokenizer's identity
    own = d / TOKENIZER_FILE
    if not own.is_file():
        raise TokenizerMismatchError(f"{own}: missing; prepared rows keep the tokenizer they were made with; "
                                     f"prepare the rows again")
    found = tokenizer_sha256(own)
    recorded = index.get("tokenizer_sha256")
    if recorded is not None and recorded != found:
        raise TokenizerMismatchError(f"{own}: sha256 {found[:12]} is not the tokenizer {d / INDEX_FILE} records "
                                     f"(sha256 {str(recorded)[:12]}): the file was replaced; prepare the rows again")
    if tokenizer is None or str(tokenizer) in ("", "bpe"):
        return
    given = Path(tokenizer).expanduser()
    if given.is_dir():
        given = given / TOKENIZER_FILE
    if not given.is_file():
        raise TokenizerMismatchError(f"data.tokenizer {str(tokenizer)!r}: no such file; give the tokenizer.json "
                                     f"the rows of {d} were prepared with ({own})")
    wanted = tokenizer_sha256(given)
    if wanted != found:
        raise TokenizerMismatchError(f"data.tokenizer {given} (sha256 {wanted[:12]}) is not the tokenizer the rows "
                                     f"of {d} were prepared with ({own}, sha256 {found[:12]}); set "
                                     f"data.tokenizer={own}, or prepare the rows again from their .jsonl with "
                                     f"this tokenizer")


class RowDataset:
    """One split of a prepared fine-tuning directory: fixed-length rows with their layout."""

    def __init__(self, prepared_dir: str | os.PathLike, split: str = "train") -> None:
        self.directory = Path(prepared_dir)
        self.index = json.loads((self.directory / INDEX_FILE).read_text(encoding="utf-8"))
        if self.index.get("format") != ROWS_FORMAT:
            raise DataError(f"{self.directory}: not a prepared fine-tuning directory (no {ROWS_FORMAT} index.json)")
        self.split = split
        self.arrays = {name: np.load(self.directory / f"{split}_{name}.npy", mmap_mode="r") for name in FIELDS}
        self.row_targets = np.load(self.directory / f"{split}_targets.npy")
        self.seq_len = int(self.index["seq_len"])
        self.vocab_size = int(self.index["vocab_size"])
        self.kind: RowFormat = self.index["kind"]
        self.row_pairs: np.ndarray | None = None
        self.row_chosen_targets: np.ndarray | None = None
        if self.kind == "preference":
            self.row_pairs = np.load(self.directory / f"{split}_pairs.npy")
            self.row_chosen_targets = np.load(self.directory / f"{split}_chosen_targets.npy")
        self.reference: np.ndarray | None = None

    @property
    def total_pairs(self) -> int:
        """Pairs of the split (0 for SFT rows)."""
        return int(self.row_pairs.sum()) if self.row_pairs is not None else 0

    def attach_reference(self, table: np.ndarray) -> None:
        """Serve ``table`` (``[total_pairs, 2]`` reference sums, see
        :mod:`plait.data.reference_table`) with every batch from now on."""
        if self.row_pairs is None:
            raise ValueError(f"{self.directory}: reference log-probabilities need preference rows")
        if table.shape != (self.total_pairs, 2):
            raise ValueError(f"{self.directory} {self.split}: a reference table of shape {table.shape} does not "
                             f"fit {self.total_pairs} pairs")
        self.reference = table

    def __len__(self) -> int:
        return int(self.arrays["input_ids"].shape[0])

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer_file(self.directory / TOKENIZER_FILE)

    @property
    def eos_id(self) -> int:
        return find_eos(self.tokenizer())[1]

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """``[len(indices), seq_len]`` int64 tensors of every field."""
        return {name: torch.from_numpy(np.asarray(a[indices], dtype=np.int64)) for name, a in self.arrays.items()}

    def targets(self, indices: list[int]) -> int:
        """Target tokens of the rows ``indices`` (read from the per-row counts, no row data)."""
        return int(self.row_targets[indices].sum())

    def pair_counts(self, indices: list[int], global_indices: list[int], microbatches: int) -> PairCounts | None:
        """Preference rows: the pairs of each micro-batch of ``indices`` and the pairs and chosen
        target tokens of the global batch ``global_indices`` (read from per-row counts); else None."""
        if self.row_pairs is None or self.row_chosen_targets is None:
            return None
        per_row = self.row_pairs[indices].reshape(microbatches, -1).sum(axis=1)
        return PairCounts(per_microbatch=tuple(int(n) for n in per_row),
                          total=int(self.row_pairs[global_indices].sum()),
                          chosen_tokens=int(self.row_chosen_targets[global_indices].sum()))

    def token_batch(self, indices: list[int], global_indices: list[int], microbatches: int) -> TokenBatch:
        """The rows ``indices`` as ``[microbatches, rows / microbatches, seq]`` with the target count
        of the whole global batch ``global_indices`` (every DP rank computes the same number) and,
        for preference rows, its pair counts."""
        fields = {k: v.reshape(microbatches, len(indices) // microbatches, -1) for k, v in self.batch(indices).items()}
        reference = None
        if self.reference is not None and self.row_pairs is not None:
            reference = batch_reference(self.reference, pair_offsets(self.row_pairs), self.row_pairs, indices,
                                        microbatches)
        return TokenBatch(input_ids=fields["input_ids"], labels=fields["labels"],
                          position_ids=fields["position_ids"], segment_ids=fields["segment_ids"],
                          loss_tokens=self.targets(global_indices),
                          pairs=self.pair_counts(indices, global_indices, microbatches), reference_logps=reference)
