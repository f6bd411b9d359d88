"""Per-token and per-sample log-probabilities from vocabulary-parallel logits.

Preference objectives need ``log p(response | prompt)`` of whole samples, not a mean loss. The
per-token log-probability of the target is the negated cross-entropy, so this module reuses
:func:`plait.tensor_parallel.vocab_parallel_cross_entropy` (three per-token reductions over the
TP group; the vocabulary is never gathered, and the backward is local to each rank's block).

Conventions (the same as :class:`plait.tensor_parallel.VocabParallelCausalLMOutput`):

* ``logits[:, t]`` predicts ``labels[:, t + 1]``; the shift happens here, so callers pass the
  unshifted labels of the batch. The output at ``t`` is the log-probability of ``labels[:, t + 1]``
  and the last position (no next token) is ignored.
* ignored targets (``ignore_index``, -100) give exactly 0.
* sequence parallelism: the output head is a column-parallel layer that all-gathers its input
  along the sequence, so the logits on the last stage are ``[b, s_full, V / tp]`` (full sequence,
  local vocabulary block) with and without SP; ``labels`` is the full ``[b, s_full]`` batch.

Packed rows: one row holds several samples back to back. Each target position carries a
*segment id*: which sample of the micro-batch the target token ``labels[:, t + 1]`` is scored for,
or -1 when it is not scored. :func:`target_segment_ids` builds it from per-position sample ids;
:func:`segment_logprob_sums` turns token log-probabilities into one sum and one count per sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

#: the segment id of a target position that belongs to no sample (padding, prompt, boundary)
NO_SEGMENT = -1


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``[b, s]`` targets: position ``t`` holds ``labels[:, t + 1]``; the last is ``ignore_index``."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def token_logprobs(logits_local: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp: GroupInfo,
                   ignore_index: int = -100) -> torch.Tensor:
    """Log-probability of each next token, ``[b, s]`` fp32, 0 where the target is ignored.

    Args:
        logits_local: ``[b, s, V_local]``, this rank's vocabulary block (``V_local = ceil(V / tp)``,
            the last block padded past ``vocab_size``); any float dtype, computed in fp32.
        labels: ``[b, s]`` unshifted token ids (``ignore_index`` where nothing is scored).
        vocab_size: the real vocabulary size; padding columns carry no probability.
        tp: the tensor-parallel group the vocabulary is sharded over (a 1-rank group: no sharding).

    Every TP rank returns the same values. The gradient w.r.t. ``logits_local`` is this rank's
    block only (``onehot - softmax``, scaled); the output head's column-parallel backward sums the
    input gradient over the group, as for the training loss.
    """
    if logits_local.dim() != 3 or labels.shape != logits_local.shape[:2]:
        raise ValueError(f"token_logprobs expects logits [b, s, V_local] and labels [b, s]; got logits "
                         f"{tuple(logits_local.shape)} and labels {tuple(labels.shape)}")
    b, s, v_local = logits_local.shape
    targets = shift_labels(labels, ignore_index).reshape(-1)
    nll = vocab_parallel_cross_entropy(logits_local.reshape(b * s, v_local), targets, vocab_size, tp,
                                       ignore_index)
    return nll.neg().view(b, s)


def target_segment_ids(sample_ids: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Segment ids aligned with :func:`token_logprobs`' output, from per-position sample ids.

    ``sample_ids[:, t]`` is the micro-batch sample that input position ``t`` belongs to (``0 ..
    num_segments - 1``; -1 for padding). The target at position ``t`` (``labels[:, t + 1]``) is
    scored for sample ``k`` only when positions ``t`` and ``t + 1`` both belong to ``k`` and the
    label is not ignored; otherwise its segment id is -1. So the first token of a packed sample,
    predicted from the previous sample's last position, is never scored, exactly as when the
    sample sits alone in its own row.
    """
    if sample_ids.shape != labels.shape or sample_ids.dim() != 2:
        raise ValueError(f"target_segment_ids expects sample_ids and labels of the same [b, s] shape; got "
                         f"{tuple(sample_ids.shape)} and {tuple(labels.shape)}")
    nxt = F.pad(sample_ids[:, 1:], (0, 1), value=NO_SEGMENT)
    scored = (nxt == sample_ids) & (shift_labels(labels, ignore_index) != ignore_index) & (sample_ids >= 0)
    return torch.where(scored, sample_ids, torch.full_like(sample_ids, NO_SEGMENT))


def segment_logprob_sums(token_lp: torch.Tensor, segment_ids: torch.Tensor,
                         num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample sums of token log-probabilities and the number of tokens summed.

    Args:
        token_lp: ``[b, s]`` from :func:`token_logprobs`.
        segment_ids: ``[b, s]`` int64, aligned with ``token_lp`` (see :func:`target_segment_ids`):
            ``k`` in ``0 .. num_segments - 1`` adds position ``t`` to sample ``k``; -1 skips it.
            Segment ids must be -1 wherever the target is ignored, or ``counts`` includes those
            positions.

    Returns ``sums`` (``token_lp``'s dtype, differentiable) and ``counts`` (int64), both
    ``[num_segments]``. No host synchronisation: skipped positions land in an overflow slot
    that is dropped, instead of being selected with a boolean mask.
    """
    if token_lp.shape != segment_ids.shape:
        raise ValueError(f"segment_logprob_sums expects token_lp and segment_ids of the same shape; got "
                         f"{tuple(token_lp.shape)} and {tuple(segment_ids.shape)}")
    if num_segments < 0:
        raise ValueError(f"num_segments={num_segments} must be >= 0")
    ids = segment_ids.reshape(-1).long()
    slot = torch.where(ids >= 0, ids, torch.full_like(ids, num_segments))  # overflow slot for -1
    sums = token_lp.new_zeros(num_segments + 1).index_add(0, slot, token_lp.reshape(-1))
    counts = torch.zeros(num_segments + 1, dtype=torch.long, device=ids.device)
    counts = counts.index_add(0, slot, torch.ones_like(slot))
    return sums[:num_segments], counts[:num_segments]


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` from per-segment values ordered ``chosen_0, rejected_0, chosen_1, ...``.

    The suggested segment numbering for preference batches: pair ``i``'s chosen response is
    segment ``2 i`` and its rejected response segment ``2 i + 1``.
    """
    if values.dim() != 1 or values.shape[0] % 2:
        raise ValueError(f"split_pairs expects a 1-D tensor of even length (chosen, rejected interleaved); "
                         f"got shape {tuple(values.shape)}")
    return values[0::2], values[1::2]


class VocabParallelTokenLogprobs(nn.Module):
    """Drop-in for a stage's ``output`` module that returns :func:`token_logprobs` ``[b, s]``.

    Same call as :class:`plait.tensor_parallel.VocabParallelCausalLMOutput` (``(logits, labels)``),
    so the last pipeline stage can hand per-token log-probabilities to a preference loss
    instead of reducing them to a mean next-token loss.
    """

    def __init__(self, vocab_size: int, tp: GroupInfo, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size, self.tp, self.ignore_index = vocab_size, tp, ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_logprobs(logits, labels, self.vocab_size, self.tp, self.ignore_index)
