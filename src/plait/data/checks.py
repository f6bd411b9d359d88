"""A prepared dataset checked against itself and against the model that will train on it.

Run at load time (``plait data prepare`` on a reused directory, ``plait train`` before launch and
each rank when it opens the data), never per step: the index records each split's largest token
id, so the checks read the index, the shard sizes and the tokenizer, not the tokens. An index
written before ``max_token_id`` was recorded costs one read of the shards instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plait.data.errors import DataError
from plait.data.token_shards import (
    INDEX_FILE,
    SPLITS,
    TOKENIZER_FILE,
    DatasetFormatError,
    TokenShards,
    check_one_sample,
    check_token_ids,
    load_index,
)
from plait.data.tokenizer import load_tokenizer_file, tokenizer_vocab_size
from plait.data.tokenizer_files import file_sha256


@dataclass(frozen=True)
class PreparedData:
    """A prepared dataset that passed :func:`verify_prepared`: its index and each split's largest id."""

    directory: Path
    index: dict
    max_token_id: dict[str, int]  # per split; -1 for an empty split

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    @property
    def tokens(self) -> dict[str, int]:
        return {split: int(self.index["splits"][split]["tokens"]) for split in SPLITS}


def verify_prepared(directory: str | Path) -> PreparedData:
    """Refuses (:class:`DataError`) a prepared dataset whose parts disagree: a malformed index, a shard
    whose size is not the index's token count (truncated or replaced), a split holding an id at or
    above the index's ``vocab_size``, or a ``tokenizer.json`` of another vocabulary or end-of-text id."""
    directory = Path(directory)
    index = load_index(directory)
    top = {}
    for split in SPLITS:
        top[split] = TokenShards(directory, split, index).max_token_id()
        check_token_ids(directory, split, top[split], int(index["vocab_size"]))
    _check_tokenizer(directory, index)
    return PreparedData(directory, index, top)


def _check_tokenizer(directory: Path, index: dict) -> None:
    """The tokenizer shipped with the data is the one the ids come from (same size, same end-of-text id):
    the trainer samples text with it and copies it next to the checkpoints."""
    path = directory / str(index.get("tokenizer", TOKENIZER_FILE))
    if not path.is_file():
        raise DatasetFormatError(f"{path}: missing; a prepared dataset holds the tokenizer its tokens were made "
                                 f"with; delete {directory} and run 'plait data prepare' again")
    tokenizer = load_tokenizer_file(path)
    size = tokenizer_vocab_size(tokenizer)
    if size != int(index["vocab_size"]):
        raise DatasetFormatError(f"{path}: the tokenizer has {size} tokens but {directory / INDEX_FILE} says "
                                 f"vocab_size {index['vocab_size']} (the tokenizer was replaced); delete "
                                 f"{directory} and run 'plait data prepare' again")
    eos_token = index.get("eos_token")
    if isinstance(eos_token, str):
        found = tokenizer.token_to_id(eos_token)
        if found != index["eos_id"]:
            raise DatasetFormatError(f"{path}: {eos_token} is id {found} but {directory / INDEX_FILE} says eos_id "
                                     f"{index['eos_id']}; delete {directory} and run 'plait data prepare' again")
    recorded = index.get("tokenizer_sha256")  # absent in datasets prepared before the identity was recorded
    if isinstance(recorded, str) and file_sha256(path) != recorded:
        raise DatasetFormatError(f"{path}: sha256 {file_sha256(path)[:12]} is not the tokenizer "
                                 f"{directory / INDEX_FILE} records (sha256 {recorded[:12]}; the tokenizer was "
                                 f"replaced by another of the same size); delete {directory} and run "
                                 f"'plait data prepare' again")


def check_model_vocab(data: PreparedData, model_vocab_size: int) -> None:
    """Refuses data that a model with ``model_vocab_size`` embedding rows could not embed: any id at or
    above it would be an IndexError with TP = 1 and, worse, a silently zero embedding under TP > 1."""
    top = max(data.max_token_id.values())
    if top >= model_vocab_size:
        raise DataError(f"{data.directory}: max token id {top} >= model vocab_size {model_vocab_size}; set "
                        f"model.vocab_size to at least {top + 1} (or null for the tokenizer's size) or prepare "
                        f"the data with the model's tokenizer")
    if data.vocab_size > model_vocab_size:
        raise DataError(f"{data.directory}: its tokenizer has {data.vocab_size} tokens, more than model "
                        f"vocab_size {model_vocab_size}; set model.vocab_size to at least {data.vocab_size} "
                        f"(or null) or prepare the data with the model's tokenizer")


def check_samples(data: PreparedData, seq_len: int) -> None:
    """Refuses a train or val split shorter than one sample of ``seq_len`` tokens."""
    for split, tokens in data.tokens.items():
        check_one_sample(data.directory, split, tokens, seq_len)


def check_for_run(directory: str | Path, *, seq_len: int, model_vocab_size: int) -> PreparedData:
    """Everything about the data a run needs, before any process starts: :func:`verify_prepared`,
    one sample of ``seq_len`` in each split, and every id below ``model_vocab_size``."""
    data = verify_prepared(directory)
    check_samples(data, seq_len)
    check_model_vocab(data, model_vocab_size)
    return data
