"""Tokenized samples laid out in rows of exactly ``seq_len`` tokens: packed several to a row, or one per row.

Every row has four int32 arrays of ``seq_len`` (convert to int64 when making tensors):

- ``input_ids``: the samples' tokens one after another, then ``pad_id``;
- ``labels``: the token id where the token is loss-bearing, ``-100`` elsewhere, and ``-100`` at the
  first token of every sample, so that no position learns to predict across a sample boundary.
  Labels are aligned with ``input_ids``, not shifted: plait's loss shifts inside the model
  (position t is scored against ``labels[t + 1]``), so the ``-100`` at a sample's first token is
  what stops the previous sample's last position from predicting it;
- ``position_ids``: 0, 1, 2, ... restarting at each sample (rotary positions as if alone);
- ``segment_ids``: the sample's index within the row (0, 1, ...), ``-1`` for padding. Attention
  must not cross segments (a block-diagonal causal mask); the model side reads this field.

Packing is greedy best-fit in input order: each unit goes to the open row with the least room that
still holds it, else to a new row; the same input gives the same rows. A unit is a sample, or a
preference pair, whose chosen and rejected samples always go to the same row, adjacent, chosen
first: in a row of pairs, segment ``2k`` is the chosen and ``2k + 1`` the rejected sample of the
row's k-th pair, so a preference loss finds both log-probabilities in one row. The unpacked mode
puts one unit per row with the same fields, so the model has one path for both.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plait.data.errors import DataError
from plait.data.sft_tokenize import PreferencePair, Sample

IGNORE_INDEX = -100  # the loss's ignore_index (plait.nn.lm_output)
PAD_SEGMENT = -1


@dataclass(frozen=True, eq=False)
class PackedRows:
    """``[rows, seq_len]`` int32 arrays (see the module doc) and which units each row holds."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    members: tuple[tuple[int, ...], ...]  # per row, the indices into the packed units, in row order
    real_tokens: int

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def efficiency(self) -> float:
        """Real tokens over row tokens: 1.0 when no row has padding."""
        total = self.input_ids.size
        return self.real_tokens / total if total else 0.0


def _parts(unit: Sample | PreferencePair) -> tuple[Sample, ...]:
    return (unit.chosen, unit.rejected) if isinstance(unit, PreferencePair) else (unit,)


def _check_units(units: Sequence[Sample | PreferencePair], seq_len: int) -> None:
    kinds = {isinstance(u, PreferencePair) for u in units}
    if len(kinds) > 1:
        raise DataError("pack() was given samples and preference pairs together; pack each kind on its own so "
                        "that segments 2k/2k+1 of a row are always one pair")
    for unit in units:
        if any(len(part) == 0 for part in _parts(unit)):
            raise DataError(f"{_parts(unit)[0].where}: an empty sample cannot be packed; drop it when tokenizing")
        if len(unit) > seq_len:
            where = _parts(unit)[0].where
            raise DataError(f"{where}: a {'pair' if isinstance(unit, PreferencePair) else 'sample'} of {len(unit)} "
                            f"tokens does not fit a row of seq_len {seq_len}; tokenize with the same seq_len")


def assign_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Best-fit in input order: per row, the unit indices it holds. Deterministic (ties go to the
    earliest row)."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (room left, row index), sorted
    for index, length in enumerate(lengths):
        at = bisect.bisect_left(open_rows, (length, -1))
        if at < len(open_rows):
            room, row = open_rows.pop(at)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(index)
        if room - length > 0:
            bisect.insort(open_rows, (room - length, row))
    return rows


def _fill_row(parts: Sequence[Sample], seq_len: int, pad_id: int) -> tuple[np.ndarray, ...]:
    ids = np.full(seq_len, pad_id, dtype=np.int32)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros(seq_len, dtype=np.int32)
    segments = np.full(seq_len, PAD_SEGMENT, dtype=np.int32)
    at = 0
    for segment, sample in enumerate(parts):
        n = len(sample)
        ids[at:at + n] = sample.input_ids
        labels[at:at + n] = np.where(sample.loss_mask, sample.input_ids, IGNORE_INDEX)
        labels[at] = IGNORE_INDEX
        positions[at:at + n] = np.arange(n, dtype=np.int32)
        segments[at:at + n] = segment
        at += n
    return ids, labels, positions, segments


def pack(units: Sequence[Sample | PreferencePair], seq_len: int, *, pad_id: int, packed: bool = True) -> PackedRows:
    """Rows of ``seq_len`` holding every unit whole; ``packed=False`` gives one unit per row."""
    _check_units(units, seq_len)
    lengths = [len(u) for u in units]
    row_members = assign_rows(lengths, seq_len) if packed else [[i] for i in range(len(units))]
    filled = [_fill_row([p for i in members for p in _parts(units[i])], seq_len, pad_id) for members in row_members]
    if filled:
        ids, labels, positions, segments = (np.stack(column) for column in zip(*filled, strict=True))
    else:
        ids = labels = positions = segments = np.zeros((0, seq_len), dtype=np.int32)
    return PackedRows(ids, labels, positions, segments, tuple(tuple(m) for m in row_members), sum(lengths))
