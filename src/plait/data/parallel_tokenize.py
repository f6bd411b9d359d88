"""Tokenising batches of documents in worker processes, in order, with bounded memory.

``plait data prepare --workers N`` (``data.num_workers``) hands batches of documents to ``N``
processes and writes their token ids in the order the batches were read, so the shards are the
same bytes for any worker count. At most :data:`IN_FLIGHT_PER_WORKER` batches per worker are
outstanding (``multiprocessing.Pool.imap`` would read the whole source ahead), so memory stays
bounded by a few batches whatever the corpus size. Workers are spawned (never forked: the parent
may hold threads, the tokenizer's among them) and load the tokenizer from its file once; each
encodes on one thread, since the processes are the parallelism.

With one worker the batches are encoded in the calling process (the tokenizer's own threads may
then use every core).
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

#: batches outstanding per worker: enough to keep every worker busy while the parent reads
IN_FLIGHT_PER_WORKER = 2


@dataclass(frozen=True)
class EncodedBatch:
    """A batch's token ids, each document followed by the end-of-text id, train and val apart."""

    train: np.ndarray
    train_documents: int
    val: np.ndarray
    val_documents: int

    @property
    def tokens(self) -> int:
        return len(self.train) + len(self.val)


def encode_documents(tok: Tokenizer, batch: list[tuple[bool, str]], eos_id: int, dtype: np.dtype) -> EncodedBatch:
    """``(is_val, text)`` documents -> their ids with an end-of-text after each, per split."""
    encoded = tok.encode_batch([text for _, text in batch], add_special_tokens=False)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for (is_val, _), enc in zip(batch, encoded, strict=True):
        ids = np.empty(len(enc.ids) + 1, dtype=dtype)
        ids[:-1] = enc.ids
        ids[-1] = eos_id
        parts[is_val].append(ids)

    def joined(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)

    return EncodedBatch(joined(parts[False]), len(parts[False]), joined(parts[True]), len(parts[True]))


# ------------------------------------------------------------------------------------ worker side

#: the tokenizer, end-of-text id and dtype of a worker process (set once by its initializer)
_worker_setup: list[tuple[Tokenizer, int, np.dtype]] = []


def _init_worker(tokenizer_file: str, eos_id: int, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the processes are the parallelism
    _worker_setup[:] = [(Tokenizer.from_file(tokenizer_file), eos_id, np.dtype(dtype))]


def _encode_in_worker(batch: list[tuple[bool, str]]) -> EncodedBatch:
    tok, eos_id, dtype = _worker_setup[0]
    return encode_documents(tok, batch, eos_id, dtype)


# ------------------------------------------------------------------------------------ parent side

def encode_in_order(batches: Iterable[list[tuple[bool, str]]], *, tok: Tokenizer, tokenizer_file: Path,
                    eos_id: int, dtype: np.dtype, workers: int) -> Iterator[EncodedBatch]:
    """The encoded ``batches``, in their order, by ``workers`` processes (1: in this process)."""
    if workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive integer")
    if workers == 1:
        for batch in batches:
            yield encode_documents(tok, batch, eos_id, dtype)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_file), eos_id, dtype.name)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
