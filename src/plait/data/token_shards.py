"""The on-disk format of a prepared dataset, its writer and its memory-mapped reader.

A prepared dataset is a directory::

    index.json          format version, dtype, shards with token counts and largest token id, vocab size,
                        eos id, key of the inputs
    tokenizer.json      the tokenizer the tokens were made with (Hugging Face ``tokenizers`` format)
    train-00000.bin     raw little-endian token ids (uint16 when the vocabulary fits, else uint32), no header
    train-00001.bin     ...
    val-00000.bin

Each split is one token stream (every document followed by the end-of-text token) cut into shards
of at most ``shard_tokens`` tokens; a document may straddle two shards. The shards are read with
``numpy.memmap``, so a dataset of any size opens instantly and only the pages touched are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO, TypeGuard

import numpy as np
import torch
from tokenizers import Tokenizer

from plait.data.errors import DataError

FORMAT = "plait-token-shards"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
SHARD_TOKENS = 1 << 24  # 16M tokens: 32 MiB per uint16 shard
DTYPES = ("uint16", "uint32")
_SCAN_TOKENS = 1 << 24  # tokens per chunk when an old index has no max_token_id and the shards are scanned


class DatasetFormatError(DataError):
    """A directory that is not a readable prepared dataset (missing, other format, truncated shard,
    an index that disagrees with its shards)."""


def _redo(directory: str | Path) -> str:
    """The fix for a damaged prepared dataset, for the end of a message."""
    return f"delete {directory} and run 'plait data prepare' again"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (``vocab_size <= 65535``), else uint32; always little-endian."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def load_index(prepared_dir: str | Path) -> dict:
    """The parsed ``index.json`` of a prepared dataset, checked for format and version."""
    path = Path(prepared_dir) / INDEX_FILE
    if not path.is_file():
        raise DatasetFormatError(f"{prepared_dir}: not a prepared dataset (no {INDEX_FILE}); "
                                 f"create one with 'plait data prepare SOURCE'")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(f"{path}: unreadable index ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DatasetFormatError(f"{path}: not a {FORMAT} index")
    if index.get("version") != FORMAT_VERSION:
        raise DatasetFormatError(f"{path}: format version {index.get('version')!r}, this plait reads "
                                 f"version {FORMAT_VERSION}; prepare the dataset again")
    _check_index_fields(path, index)
    return index


def _is_count(value: object, low: int = 0) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_index_fields(path: Path, index: dict) -> None:
    """The fields the readers rely on, present and of the right kind, so a hand-edited or damaged
    index is refused here with its path instead of failing later with a KeyError."""
    def bad(what: str) -> DatasetFormatError:
        return DatasetFormatError(f"{path}: {what}; {_redo(path.parent)}")

    if index.get("dtype") not in DTYPES:
        raise bad(f"dtype {index.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    vocab = index.get("vocab_size")
    if not _is_count(vocab, 1):
        raise bad(f"vocab_size {vocab!r} is not a positive integer")
    if vocab > np.iinfo(np.dtype(index["dtype"])).max + 1:
        raise bad(f"vocab_size {vocab} does not fit dtype {index['dtype']}")
    eos = index.get("eos_id")
    if not _is_count(eos) or eos >= vocab:
        raise bad(f"eos_id {eos!r} is not a token id below vocab_size {vocab}")
    splits = index.get("splits")
    for split in SPLITS:
        entry = splits.get(split) if isinstance(splits, dict) else None
        if not isinstance(entry, dict) or not _is_count(entry.get("tokens")) \
                or not isinstance(entry.get("shards"), list):
            raise bad(f"splits.{split} is missing or has no 'tokens' and 'shards'")
        for shard in entry["shards"]:
            if not isinstance(shard, dict) or not isinstance(shard.get("file"), str) \
                    or Path(shard["file"]).name != shard["file"] or not _is_count(shard.get("tokens")):
                raise bad(f"splits.{split}.shards holds {shard!r}, expected {{file: NAME, tokens: N}}")


class ShardWriter:
    """Appends token arrays to ``<split>-NNNNN.bin`` files, starting a new shard every ``shard_tokens``."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens={shard_tokens} must be positive")
        self.directory, self.split = Path(directory), split
        self.dtype, self.shard_tokens = np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []  # {"file", "tokens"} of every shard begun
        self.documents = 0
        self.tokens = 0
        self.max_token_id = -1  # recorded in the index, so readers check the model's vocabulary without a scan
        self._fh: BinaryIO | None = None

    def add(self, tokens: np.ndarray, documents: int = 1) -> None:
        tokens = np.asarray(tokens, dtype=self.dtype)
        self.documents += documents
        if tokens.size:
            self.max_token_id = max(self.max_token_id, int(tokens.max()))
        pos = 0
        while pos < tokens.size:
            fh = self._fh
            if fh is None or self.shards[-1]["tokens"] == self.shard_tokens:
                fh = self._open_next()
            take = min(tokens.size - pos, self.shard_tokens - self.shards[-1]["tokens"])
            fh.write(tokens[pos:pos + take].tobytes())
            self.shards[-1]["tokens"] += take
            self.tokens += take
            pos += take

    def _open_next(self) -> BinaryIO:
        """Closes the current shard and begins the next; returns its file."""
        if self._fh is not None:
            self._fh.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._fh = fh = open(self.directory / name, "wb")
        self.shards.append({"file": name, "tokens": 0})
        return fh

    def close(self) -> dict:
        """Flushes the last shard; returns the split's index entry."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return {"tokens": self.tokens, "documents": self.documents, "max_token_id": self.max_token_id,
                "shards": [dict(s) for s in self.shards]}


class TokenShards:
    """One split's token stream, memory-mapped across its shards; ``read(start, stop)`` crosses shard ends."""

    def __init__(self, prepared_dir: str | Path, split: str, index: dict | None = None):
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not valid; expected one of {SPLITS}")
        self.directory = Path(prepared_dir)
        self.index = index if index is not None else load_index(self.directory)
        self.split = split
        self.dtype = np.dtype(self.index["dtype"])
        entry = self.index["splits"][split]
        self._files = [self.directory / s["file"] for s in entry["shards"]]
        self._counts = [int(s["tokens"]) for s in entry["shards"]]
        self._ends = np.cumsum(self._counts, dtype=np.int64)
        self.num_tokens = int(self._ends[-1]) if self._counts else 0
        if self.num_tokens != int(entry["tokens"]):
            raise DatasetFormatError(f"{self.directory / INDEX_FILE}: the {split} shards listed hold "
                                     f"{self.num_tokens} tokens, splits.{split}.tokens says {entry['tokens']}; "
                                     f"{_redo(self.directory)}")
        for path, count in zip(self._files, self._counts, strict=True):
            size = path.stat().st_size if path.is_file() else -1
            if size != count * self.dtype.itemsize:
                found = "no file" if size < 0 else f"{size} bytes"
                raise DatasetFormatError(f"{path}: expected {count} {self.dtype.name} tokens "
                                         f"({count * self.dtype.itemsize} bytes) as {INDEX_FILE} says, found "
                                         f"{found} (a truncated or replaced shard); {_redo(self.directory)}")
        self._maps: list[np.memmap] | None = None

    def _mapped(self) -> list[np.memmap]:
        if self._maps is None:  # opened lazily, so that a pickled copy (a worker process) maps its own
            self._maps = [np.memmap(p, dtype=self.dtype, mode="r", shape=(n,))
                          for p, n in zip(self._files, self._counts, strict=True)]
        return self._maps

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def max_token_id(self) -> int:
        """The largest token id of the split (-1 when empty): the index's ``max_token_id`` when it has
        one; an index written before that field existed costs one read of the shards."""
        recorded = self.index["splits"][self.split].get("max_token_id")
        if recorded is not None:
            if not _is_count(recorded, -1):
                raise DatasetFormatError(f"{self.directory / INDEX_FILE}: splits.{self.split}.max_token_id "
                                         f"{recorded!r} is not an integer; {_redo(self.directory)}")
            return recorded
        top = -1
        for shard in self._mapped():
            for start in range(0, shard.shape[0], _SCAN_TOKENS):
                top = max(top, int(shard[start:start + _SCAN_TOKENS].max()))
        return top

    def __len__(self) -> int:
        return self.num_tokens

    def read_into(self, out: np.ndarray, start: int) -> None:
        """Fills ``out`` (1-D, any integer dtype) with tokens ``[start, start + len(out))``."""
        stop = start + out.shape[0]
        if start < 0 or stop > self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) out of range for {self.num_tokens} {self.split} tokens")
        maps, pos = self._mapped(), start
        shard = int(np.searchsorted(self._ends, start, side="right"))
        while pos < stop:
            first = int(self._ends[shard]) - self._counts[shard]
            take = min(stop, int(self._ends[shard])) - pos
            out[pos - start:pos - start + take] = maps[shard][pos - first:pos - first + take]
            pos += take
            shard += 1

    def read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=self.dtype)
        self.read_into(out, start)
        return out


def check_token_ids(directory: str | Path, split: str, max_token_id: int, vocab_size: int) -> None:
    """Refuses a split whose largest token id is not below ``vocab_size`` (the index's, or a model's)."""
    if max_token_id >= vocab_size:
        raise DatasetFormatError(f"{Path(directory) / INDEX_FILE}: the {split} split's max token id {max_token_id} "
                                 f">= vocab_size {vocab_size} (the tokens were not made with this dataset's "
                                 f"tokenizer); {_redo(directory)}")


def check_one_sample(directory: str | Path, split: str, num_tokens: int, seq_len: int) -> None:
    """Refuses a split too short for one training sample of ``seq_len`` tokens (the labels are the
    same tokens shifted inside the loss, so a sample needs ``seq_len`` tokens, not one more)."""
    if num_tokens < seq_len:
        more = "a larger data.val_fraction (--val-fraction)" if split == "val" else "more text"
        fix = f"a data.seq_len of at most {num_tokens} or {more}" if num_tokens else more
        raise DataError(f"{directory}: the {split} split has {num_tokens} tokens, fewer than one sample of "
                        f"data.seq_len={seq_len}; use {fix}")


class TokenDataset(torch.utils.data.Dataset):
    """Fixed-length samples of one split: sample ``i`` is tokens ``[i*seq_len, (i+1)*seq_len)`` (int64).

    The tail shorter than ``seq_len`` is not used. Samples ignore document boundaries: documents
    are separated by the end-of-text token (``eos_id``) inside the stream.
    """

    def __init__(self, prepared_dir: str | Path, split: str = "train", seq_len: int = 1024):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
        self.directory = Path(prepared_dir)
        self.index = load_index(self.directory)
        self.split, self.seq_len = split, seq_len
        self.shards = TokenShards(self.directory, split, self.index)
        self.num_tokens = self.shards.num_tokens
        self.vocab_size: int = int(self.index["vocab_size"])
        self.eos_id: int = int(self.index["eos_id"])
        check_token_ids(self.directory, split, self.shards.max_token_id(), self.vocab_size)
        check_one_sample(self.directory, split, self.num_tokens, seq_len)

    def __len__(self) -> int:
        return self.num_tokens // self.seq_len

    def _check(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} {self.split} samples")
        return i % n

    def __getitem__(self, i: int) -> torch.Tensor:
        i = self._check(int(i))
        out = np.empty(self.seq_len, dtype=np.int64)
        self.shards.read_into(out, i * self.seq_len)
        self._check_ids(out, [i])
        return torch.from_numpy(out)

    def batch(self, indices: list[int]) -> torch.Tensor:
        """``[len(indices), seq_len]`` int64: the samples at ``indices``, read straight into one array."""
        out = np.empty((len(indices), self.seq_len), dtype=np.int64)
        for row, i in enumerate(indices):
            self.shards.read_into(out[row], self._check(int(i)) * self.seq_len)
        self._check_ids(out, indices)
        return torch.from_numpy(out)

    def _check_ids(self, out: np.ndarray, indices: list[int]) -> None:
        """Last line of defence, on the host before a batch leaves the loader: no id at or above the
        index's vocabulary (which the model's is at least), even if shards were altered after the
        index recorded their largest id. One pass over an array the loader just wrote; no device sync."""
        if out.size and int(out.max()) >= self.vocab_size:
            row = int(np.argmax(out.max(axis=-1))) if out.ndim > 1 else 0
            raise DatasetFormatError(f"{self.directory}: {self.split} sample {int(indices[row])} holds token id "
                                     f"{int(out.max())} >= vocab_size {self.vocab_size} of its {INDEX_FILE} "
                                     f"(the shards disagree with the index); {_redo(self.directory)}")

    def tokenizer(self) -> Tokenizer:
        """The ``tokenizers.Tokenizer`` the dataset was made with."""
        return Tokenizer.from_file(str(self.directory / self.index.get("tokenizer", TOKENIZER_FILE)))
