"""The one error type of the data side, so that every command reports a data problem the same way.

``plait data prepare`` and ``plait train`` (before launch, and each rank at load time) call the
same functions; any of them that finds a source, a prepared dataset or a tokenizer unusable raises
a :class:`DataError` whose message is one line naming the file (and the line, for JSONL), the
numbers that disagree, and the fix. Commands catch ``DataError`` and print its message.
"""

from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be used: a bad source, a damaged or inconsistent prepared dataset, too little text."""


class RowError(DataError):
    """One malformed row of SFT, preference or prompt data; ``reason`` is a key of
    :data:`plait.data.sft_rows.REASONS` (rows skipped with ``skip_bad_rows`` are counted by it)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
