"""A step's batch cut for one cp rank: every ``[microbatches, micro_batch, seq]`` field keeps this
rank's two chunks of each row (:class:`~plait.context_parallel.split.SequenceSplit`).

* ``labels`` become the *targets* before the cut (shifted by one on the whole row, ``-100`` after
  the last token), since a chunk's last token is scored against the first token of the next chunk,
  which another rank holds; :class:`~plait.context_parallel.sequence_loss.ContextParallelOutput` takes them
  as they are.
* ``position_ids`` are always set: the global index of each kept token for plain rows, or the
  packed row's own positions (restarting in each document); rotary follows them.
* ``segment_ids`` (packed rows): each micro-batch is cut by the chunk pairs that balance its
  attention work (:func:`~plait.context_parallel.balance.balanced_split`; zigzag for one document
  per row), so packed micro-batches may use another split than plain ones; the local ids carry
  every token's chunk number, so the attention knows each rank's chunks without another message.
* ``loss_tokens`` (target tokens of the global batch) is unchanged: the loss is the whole
  micro-batch's on every cp rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from plait.context_parallel.balance import balanced_split
from plait.context_parallel.split import SequenceSplit
from plait.data.batch import TokenBatch, as_token_batch

IGNORE_INDEX = -100


def shifted_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels[..., t + 1]`` at position ``t`` and ``ignore_index`` at the last position."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def encode_chunks(segments: torch.Tensor, split: SequenceSplit, rank: int) -> torch.Tensor:
    """``rank``'s local segment ids with the global chunk of each token folded in:
    ``document * 2cp + chunk`` (see :func:`decode_chunks`)."""
    n, k = split.chunk_len, 2 * split.cp
    chunk = torch.tensor(split.chunks(rank), device=segments.device).repeat_interleave(n)
    return segments * k + chunk


def decode_chunks(encoded: torch.Tensor, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(document ids, chunk ids)`` of :func:`encode_chunks`' values (padding's -1 survives)."""
    k = 2 * cp
    return torch.div(encoded, k, rounding_mode="floor"), torch.remainder(encoded, k)


def split_token_batch(batch: torch.Tensor | TokenBatch, split: SequenceSplit, rank: int, *,
                      balance: bool = True) -> TokenBatch:
    """``rank``'s share of ``batch`` (see the module docstring).

    Packed rows (``segment_ids``) of each micro-batch are cut by
    :func:`~plait.context_parallel.balance.balanced_split` (chunk pairs balanced by attention work)
    when ``balance``, else by ``split``; their local segment ids carry each token's chunk
    (:func:`encode_chunks`), from which the cp attention learns every rank's chunks.
    """
    tokens = as_token_batch(batch)
    if tokens.pairs is not None:
        raise ValueError("preference rows cannot be split over context-parallel ranks (their objective needs "
                         "whole sequences); use parallel.cp=1 for preference training")
    ids = tokens.input_ids
    labels = shifted_targets(tokens.labels if tokens.labels is not None else ids)
    if tokens.position_ids is not None:
        positions = tokens.position_ids
    else:
        positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    if tokens.segment_ids is None:
        return replace(tokens, input_ids=split.split(ids, rank), labels=split.split(labels, rank),
                       position_ids=split.split(positions, rank))
    parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
    for m, segments in enumerate(tokens.segment_ids):
        cut = balanced_split(segments, split.cp) if balance else split
        parts["input_ids"].append(cut.split(ids[m], rank))
        parts["labels"].append(cut.split(labels[m], rank))
        parts["position_ids"].append(cut.split(positions[m], rank))
        parts["segment_ids"].append(encode_chunks(cut.split(segments, rank), cut, rank))
    return replace(tokens, input_ids=torch.stack(parts["input_ids"]), labels=torch.stack(parts["labels"]),
                   position_ids=torch.stack(parts["position_ids"]), segment_ids=torch.stack(parts["segment_ids"]))
