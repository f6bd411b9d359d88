"""The causal language-model output: logits, or the next-token loss when labels are given."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class SequenceLoss(Protocol):
    """A loss of whole sequences computed from the last stage's logits in place of the output
    module's next-token loss (a preference objective bound to one micro-batch): ``(logits
    [b, s, V_local], labels [b, s]) -> scalar``."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...


class CausalLMOutput(nn.Module):
    """Turns output-head logits into the next-token loss (when labels are given) or full logits.

    ``labels`` are aligned with ``input_ids`` (position t predicts ``labels[t+1]``); positions
    labelled ``ignore_index`` do not count. The loss is the mean over counted tokens, or, with
    ``loss_normalizer``, their sum divided by it (so a step over micro-batches and data-parallel
    ranks with different numbers of target tokens can average over all of them, not per batch).
    The tensor-parallel plan replaces this module with a vocab-parallel one.
    """

    def __init__(self, vocab_size: int, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None,
                loss_normalizer: float | None = None) -> torch.Tensor:
        if labels is None:
            return logits
        # Shift the labels, not the logits: the logits are the largest activation and slicing
        # them would copy it. The last position gets ``ignore_index``.
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=self.ignore_index).reshape(-1)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        if loss_normalizer is None:
            return F.cross_entropy(flat, shift_labels, ignore_index=self.ignore_index)
        return F.cross_entropy(flat, shift_labels, ignore_index=self.ignore_index, reduction="sum") / loss_normalizer
