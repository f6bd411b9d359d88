"""The preference loss on the last pipeline stage: logits -> per-pair log-probabilities -> loss.

A :class:`PreferenceHead` is bound to each micro-batch by the pipeline runtime
(:meth:`PreferenceHead.bind`); the last stage calls the bound loss with its logits instead of its
next-token output module. Nothing here gathers the vocabulary: token log-probabilities come from
the vocabulary-parallel cross-entropy (:func:`plait.post_training.logprobs.token_logprobs`).

Normalisation: the loss of a step is the mean over *all* pairs of the global batch (and the
optional SFT term the mean NLL over all its chosen tokens), for every layout. A micro-batch
returns its per-pair loss *sum* divided by ``total_pairs / (microbatches * dp)``; the runtime
divides by the micro-batch count and data parallelism averages over ranks, which leaves
``sum / total_pairs``. The counts come from the data (per-row pair counts stored when the rows
were prepared), so no rank communicates to learn them.

Reference log-probabilities (DPO, IPO): a forward-only pass over the same batch runs first with
the head in reference mode (:meth:`PreferenceHead.collecting_reference`); the last stage then
keeps each micro-batch's reference sums on the device until that micro-batch's policy loss.
With ``preference.reference: precompute`` the batch carries them instead
(:attr:`TokenBatch.reference_logps`, read from the prepared data's table).

Metrics stay on the device: each micro-batch adds pair-weighted sums to an accumulator (one for
training, one for evaluation) that :meth:`PreferenceHead.read` reduces and reads once per
logging interval.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist

from plait.comm.primitives import GroupInfo
from plait.data.batch import TokenBatch
from plait.post_training.logprobs import (
    NO_SEGMENT,
    segment_logprob_sums,
    split_pairs,
    target_segment_ids,
    token_logprobs,
)
from plait.post_training.objectives import REFERENCE_OBJECTIVES, PreferenceSettings, preference_loss

#: pair-weighted metrics of every objective (means over pairs once read)
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
                "logps/rejected")
#: ORPO's own metrics
ORPO_METRICS = ("orpo/log_odds_ratio", "orpo/odds_ratio_loss")
#: accumulator slots besides the pair metrics: pairs, the per-pair loss sum, chosen NLL sum, chosen tokens
_PAIRS, _LOSS = 0, 1


def microbatch_sample_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` segment ids unique across the micro-batch's rows: row ``r``'s segments shifted by
    twice the pairs of the rows before it, so pair ``i`` of the micro-batch is ``2i`` (chosen) and
    ``2i + 1`` (rejected). Device-side (no host read); padding stays -1."""
    row_pairs = (segment_ids.amax(dim=1).clamp(min=NO_SEGMENT) + 1) // 2
    offset = 2 * (torch.cumsum(row_pairs, 0) - row_pairs)
    return torch.where(segment_ids >= 0, segment_ids + offset[:, None], torch.full_like(segment_ids, NO_SEGMENT))


class PreferenceHead:
    """The preference objective of a run, bound to micro-batches by the pipeline runtime.

    Args:
        objective: ``dpo``, ``ipo``, ``orpo`` or ``simpo``.
        settings: the objective's knobs (``sft_weight`` ``None``: the objective's default).
        vocab_size: the real vocabulary (padding columns of the last TP block carry no probability).
        tp: the group the vocabulary is sharded over.
        microbatches, dp_size: the runtime's micro-batch count and the data-parallel degree (the
            loss normalisation, see the module doc).
    """

    def __init__(self, objective: str, settings: PreferenceSettings, *, vocab_size: int, tp: GroupInfo,
                 microbatches: int, dp_size: int, device: torch.device) -> None:
        settings.check_for(objective)
        self.objective, self.vocab_size, self.tp = objective, vocab_size, tp
        self.sft_weight = settings.sft_weight_for(objective)
        self.pair_settings = replace(settings, sft_weight=0.0)  # the SFT term is normalised by global tokens here
        self.shards = microbatches * dp_size
        self.needs_reference = objective in REFERENCE_OBJECTIVES
        self.metric_names = PAIR_METRICS + (ORPO_METRICS if objective == "orpo" else ())
        self.device = device
        size = 2 + len(self.metric_names) + 2  # pairs, loss sum, metrics, chosen NLL sum, chosen tokens
        self._sums = {split: torch.zeros(size, dtype=torch.float64, device=device) for split in ("train", "eval")}
        self._reference: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._collecting_reference = False

    # ------------------------------------------------------------------ reference
    @contextlib.contextmanager
    def collecting_reference(self) -> Iterator[None]:
        """Micro-batches bound inside store their reference sums (and return a zero loss)."""
        self._reference.clear()
        self._collecting_reference = True
        try:
            yield
        finally:
            self._collecting_reference = False

    def take_reference(self, microbatch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (chosen, rejected) reference sums stored for ``microbatch`` by the last pass in
        :meth:`collecting_reference` (``None`` on ranks without the last stage); removed."""
        return self._reference.pop(microbatch, None)

    # ------------------------------------------------------------------ the loss
    def bind(self, tokens: TokenBatch, microbatch: int, train: bool):
        """The loss the last stage computes from ``(logits, labels)`` for ``microbatch`` of ``tokens``."""
        if tokens.pairs is None or tokens.segment_ids is None:
            raise ValueError("a preference objective needs preference rows (data.format preference): the batch "
                             "carries no pair counts or segments")
        if self._collecting_reference:
            return functools.partial(self._store_reference, tokens, microbatch)
        return functools.partial(self._loss, tokens, microbatch, "train" if train else "eval")

    def pair_logprobs(self, logits: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor,
                      pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(chosen sums, rejected sums, chosen counts, rejected counts)``, each ``[pairs]``."""
        token_lp = token_logprobs(logits, labels, self.vocab_size, self.tp)
        targets = target_segment_ids(microbatch_sample_ids(segment_ids), labels)
        sums, counts = segment_logprob_sums(token_lp, targets, 2 * pairs)
        chosen, rejected = split_pairs(sums)
        chosen_counts, rejected_counts = split_pairs(counts)
        return chosen, rejected, chosen_counts, rejected_counts

    def _inputs(self, tokens: TokenBatch, microbatch: int) -> tuple[torch.Tensor, int]:
        assert tokens.pairs is not None and tokens.segment_ids is not None, "checked in bind"
        return tokens.segment_ids[microbatch], tokens.pairs.per_microbatch[microbatch]

    def _store_reference(self, tokens: TokenBatch, microbatch: int, logits: torch.Tensor,
                         labels: torch.Tensor) -> torch.Tensor:
        segment_ids, pairs = self._inputs(tokens, microbatch)
        chosen, rejected, _, _ = self.pair_logprobs(logits, labels, segment_ids, pairs)
        self._reference[microbatch] = (chosen.detach(), rejected.detach())
        return logits.new_zeros((), dtype=torch.float32)

    def _loss(self, tokens: TokenBatch, microbatch: int, split: str, logits: torch.Tensor,
              labels: torch.Tensor) -> torch.Tensor:
        segment_ids, pairs = self._inputs(tokens, microbatch)
        assert tokens.pairs is not None, "checked in bind"
        chosen, rejected, chosen_counts, rejected_counts = self.pair_logprobs(logits, labels, segment_ids, pairs)
        ref_chosen = ref_rejected = None
        if self.needs_reference:
            if microbatch in self._reference:
                ref_chosen, ref_rejected = self._reference.pop(microbatch)
            elif tokens.reference_logps is not None:  # preference.reference: precompute
                stored = tokens.reference_logps[microbatch, :pairs]
                ref_chosen, ref_rejected = stored[:, 0], stored[:, 1]
            else:
                raise RuntimeError(f"objective {self.objective!r}: no reference log-probabilities for micro-batch "
                                   f"{microbatch}; the reference pass must run before the policy pass")
        mean, metrics = preference_loss(self.objective, chosen, rejected, ref_chosen, ref_rejected, chosen_counts,
                                        rejected_counts, self.pair_settings)
        scale = self.shards / max(tokens.pairs.total, 1)
        loss = mean * (pairs * scale)
        nll_sum = -chosen.sum()
        chosen_tokens = chosen_counts.sum()
        if self.sft_weight > 0:
            token_scale = self.shards / max(tokens.pairs.chosen_tokens, 1)
            loss = loss + self.sft_weight * nll_sum * token_scale
        values = torch.stack([v.detach().double() for v in (mean, *(metrics[n] for n in self.metric_names))])
        acc = self._sums[split]  # in-place, python scalars as kernel arguments: no host-device copy
        acc[_PAIRS] += pairs
        acc[_LOSS:-2] += values * pairs
        acc[-2:] += torch.stack([nll_sum.detach().double(), chosen_tokens.double()])
        return loss

    # ------------------------------------------------------------------ metrics
    def read(self, split: str, *groups: GroupInfo | None) -> dict[str, float]:
        """Pair-weighted means of the metrics since the last read of ``split`` (``train``/``eval``),
        summed over ``groups`` (the pipeline group, whose last stage alone adds, and the data-parallel
        group) with one host read; then reset. ``loss`` is the objective's loss over those pairs
        (the per-pair term plus the SFT term), ``loss/nll`` the chosen responses' token NLL."""
        sums = self._sums[split]
        self._sums[split] = torch.zeros_like(sums)
        for g in groups:
            if g is not None and g.size > 1:
                dist.all_reduce(sums, group=g.group)
        values = sums.tolist()
        pairs = values[_PAIRS]
        nll_sum, chosen_tokens = values[-2], values[-1]
        if pairs <= 0:
            return {}
        out = {name: v / pairs for name, v in zip(self.metric_names, values[_LOSS + 1:-2], strict=True)}
        nll = nll_sum / chosen_tokens if chosen_tokens > 0 else float("nan")
        out["loss"] = values[_LOSS] / pairs + self.sft_weight * (nll if self.sft_weight > 0 else 0.0)
        out["loss/nll"] = nll
        return out
