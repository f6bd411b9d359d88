"""The unigram baseline: what a model that ignores context would score on the validation split.

A trained language model's validation loss should fall well below this number; it is printed
next to the final validation loss so a user can tell learning from memorising token frequencies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plait.data.token_shards import TokenShards


def unigram_loss(prepared_dir: str | Path, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the val tokens under add-one smoothed train unigram frequencies."""
    train, val = TokenShards(prepared_dir, "train"), TokenShards(prepared_dir, "val")
    counts = np.bincount(train.read(0, train.num_tokens).astype(np.int64), minlength=vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val.read(0, val.num_tokens).astype(np.int64)].mean())
