"""Vocabulary-parallel replacement of the causal-LM output module.

With labels it returns the mean next-token loss computed by the vocab-parallel cross-entropy
(the full logits are never gathered). Without labels it gathers the logits over the TP group
and drops the vocabulary padding, for generation and inspection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.comm import collectives as C
from plait.comm.primitives import GroupInfo
from plait.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


class VocabParallelCausalLMOutput(nn.Module):
    def __init__(self, vocab_size: int, tp: GroupInfo, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size, self.tp, self.ignore_index = vocab_size, tp, ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None,
                loss_normalizer: float | None = None) -> torch.Tensor:
        """As :class:`plait.nn.lm_output.CausalLMOutput` (mean over target tokens, or their sum
        divided by ``loss_normalizer``), with the vocabulary sharded over TP."""
        if labels is None:
            return C.gather_from_tp(logits, -1, self.tp.group)[..., : self.vocab_size]
        # Shift the labels (a copy of the logits would cost the largest activation again).
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=self.ignore_index).reshape(-1)
        per_token = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels,
                                                 self.vocab_size, self.tp, self.ignore_index)
        if loss_normalizer is not None:
            return per_token.sum() / loss_normalizer
        count = (shift_labels != self.ignore_index).sum().clamp(min=1)
        return per_token.sum() / count
