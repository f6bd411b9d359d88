"""Test helper: documents -> one token stream (joined by the end-of-text token) -> fixed-length sequences."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from plait.data.errors import DataError
from plait.data.tokenizer import EOS


def token_stream(documents: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise DataError(f"the tokenizer has no {EOS} token to join documents with")
    ids: list[int] = []
    for enc in tokenizer.encode_batch(documents):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def split_sequences(stream: torch.Tensor, seq_len: int,
                    val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` tensors of shape ``[n, seq_len]``; the validation split is the stream's tail."""
    n = stream.numel() // seq_len
    seqs = stream[: n * seq_len].view(n, seq_len)
    n_val = max(1, int(n * val_fraction))
    return seqs[:-n_val], seqs[-n_val:]


def batch_at(seqs: torch.Tensor, step: int, batch_size: int, seed: int = 0) -> torch.Tensor:
    """The ``step``-th batch of a fixed pseudo-random permutation (identical on every rank)."""
    epoch_len = seqs.shape[0] // batch_size
    epoch, within = divmod(step, epoch_len)
    perm = torch.randperm(seqs.shape[0], generator=torch.Generator().manual_seed(seed + epoch))
    return seqs[perm[within * batch_size:(within + 1) * batch_size]]
