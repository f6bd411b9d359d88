"""The causal language-model output: logits, or the next-token loss when labels are given."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalLMOutput(nn.Module):
    """Turns output-head logits into the next-token loss (when labels are given) or full logits.

    ``labels`` are aligned with ``input_ids`` (position t predicts ``labels[t+1]``); positions
    labelled ``ignore_index`` do not count. The loss is the mean over counted tokens.
    The tensor-parallel plan replaces this module with a vocab-parallel one.
    """

    def __init__(self, vocab_size: int, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return logits
        # Shift the labels, not the logits: the logits are the largest activation and slicing
        # them would copy it. The last position gets ``ignore_index``.
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=self.ignore_index).reshape(-1)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift_labels,
                               ignore_index=self.ignore_index)
