"""A step's batch cut for one cp rank: every ``[microbatches, micro_batch, seq]`` field keeps this
rank's two chunks of each row (:class:`~plait.context_parallel.split.SequenceSplit`).

* ``labels`` become the *targets* before the cut (shifted by one on the whole row, ``-100`` after
  the last token), since a chunk's last token is scored against the first token of the next chunk,
  which another rank holds; :class:`~plait.context_parallel.output.ContextParallelOutput` takes them
  as they are.
* ``position_ids`` are always set: the global index of each kept token for plain rows, or the
  packed row's own positions (restarting in each document); rotary follows them.
* ``segment_ids`` (document ids, the same values on every rank) are cut like the tokens.
* ``loss_tokens`` (target tokens of the global batch) is unchanged: the loss is the whole
  micro-batch's on every cp rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from plait.context_parallel.split import SequenceSplit
from plait.data.batch import TokenBatch, as_token_batch

IGNORE_INDEX = -100


def shifted_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels[..., t + 1]`` at position ``t`` and ``ignore_index`` at the last position."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def split_token_batch(batch: torch.Tensor | TokenBatch, split: SequenceSplit, rank: int) -> TokenBatch:
    """``rank``'s share of ``batch`` (see the module docstring)."""
    tokens = as_token_batch(batch)
    if tokens.pairs is not None:
        raise ValueError("preference rows cannot be split over context-parallel ranks (their objective needs "
                         "whole sequences); use parallel.cp=1 for preference training")
    ids = tokens.input_ids
    labels = tokens.labels if tokens.labels is not None else ids
    if tokens.position_ids is not None:
        positions = tokens.position_ids
    else:
        positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    return replace(
        tokens,
        input_ids=split.split(ids, rank),
        labels=split.split(shifted_targets(labels), rank),
        position_ids=split.split(positions, rank),
        segment_ids=None if tokens.segment_ids is None else split.split(tokens.segment_ids, rank),
    )
