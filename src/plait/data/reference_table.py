"""Precomputed reference log-probabilities stored next to the prepared preference rows.

``preference.reference: precompute`` runs the reference model once over every pair of a
prepared directory and keeps the result in it, so later runs of DPO or IPO on the same data and
the same initial model need neither a second model in memory nor a second forward pass per step.

Layout: ``<prepared dir>/reference/<key>/<split>.npy``, a float32 ``[pairs of the split, 2]``
array of (chosen, rejected) sequence log-probability sums, pairs in row order and, inside a row,
in segment order (pair ``k`` of a row is its segments ``2k`` and ``2k + 1``). ``key`` names the
reference model and numerics (see :func:`reference_key`); a table is written whole under a
temporary name and renamed into place, so a killed pass leaves no table behind, and another
model's table is never replaced.

float32 is the dtype the head computes the sums in, so a stored value is bit-for-bit what a
frozen reference would give in the same layout. Different layouts sum in different orders: a
table computed under one layout differs from another layout's live reference by float32
round-off (about 1e-7 relative), which is why the key does not include the layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: sub-directory of a prepared directory holding reference tables
REFERENCE_DIR = "reference"


def reference_key(identity: dict[str, Any]) -> str:
    """A short stable hash of ``identity`` (JSON-serialisable description of the reference model)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def table_path(prepared_dir: str | os.PathLike, key: str, split: str) -> Path:
    return Path(prepared_dir) / REFERENCE_DIR / key / f"{split}.npy"


def pair_offsets(row_pairs: np.ndarray) -> np.ndarray:
    """Index of each row's first pair in a split's table (``[rows + 1]``, the last = total pairs)."""
    return np.concatenate([[0], np.cumsum(row_pairs, dtype=np.int64)])


def load_table(prepared_dir: str | os.PathLike, key: str, split: str, pairs: int) -> np.ndarray | None:
    """The stored table of ``split`` for ``key``, or ``None`` when there is none (or it does not
    hold ``pairs`` pairs: then it belongs to other rows and is not used)."""
    path = table_path(prepared_dir, key, split)
    if not path.is_file():
        return None
    table = np.load(path)
    if table.shape != (pairs, 2) or table.dtype != np.float32:
        return None
    return table


def write_table(prepared_dir: str | os.PathLike, key: str, split: str, table: np.ndarray) -> Path:
    """Write ``table`` whole: a temporary file in the same directory, then an atomic rename."""
    path = table_path(prepared_dir, key, split)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".npy", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.ascontiguousarray(table, dtype=np.float32))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def batch_reference(table: np.ndarray, offsets: np.ndarray, row_pairs: np.ndarray, indices: list[int],
                    microbatches: int) -> torch.Tensor:
    """The reference sums of the rows ``indices`` split into ``microbatches`` equal groups of rows:
    ``[microbatches, max pairs of a group, 2]``, each group's pairs first (in row order), zeros after."""
    groups = np.asarray(indices, dtype=np.int64).reshape(microbatches, -1)
    per_group = [np.concatenate([table[offsets[r]:offsets[r] + row_pairs[r]] for r in rows]) for rows in groups]
    width = max(1, max(len(g) for g in per_group))
    out = np.zeros((microbatches, width, 2), dtype=np.float32)
    for m, values in enumerate(per_group):
        out[m, :len(values)] = values
    return torch.from_numpy(out)


__all__ = ["REFERENCE_DIR", "batch_reference", "load_table", "pair_offsets", "reference_key", "table_path",
           "write_table"]
