"""A step's batch as the pipeline runtime consumes it: token ids and, for fine-tuning data, the
labels, the packed-row layout and the loss normalisation.

Plain pretraining text needs only ``input_ids`` (the labels are the ids themselves and every
position is a target). Fine-tuning rows carry ``labels`` with ``-100`` where no loss is taken
(prompt tokens, sample starts, padding), and packed rows carry ``position_ids`` (restarting at 0
in each sample) and ``segment_ids`` (which sample of the row a token belongs to).

``loss_tokens`` is the number of target tokens of the whole *global* batch (every micro-batch of
every data-parallel rank). With it the loss of a step is the sum of the per-token losses divided
by that number, the same for every layout, instead of a mean of per-micro-batch means, which
would weight a token by how full its micro-batch happened to be.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class PairCounts:
    """Preference rows: how many pairs a step holds, known on every rank without communication.

    In a preference row segment ``2k`` is the chosen and ``2k + 1`` the rejected sample of the
    row's ``k``-th pair. The loss of a step is the mean over ``total`` pairs (and the optional SFT
    term the mean over ``chosen_tokens``), whatever the layout.
    """

    #: pairs of each of this rank's micro-batches (host ints: they size the per-pair tensors)
    per_microbatch: tuple[int, ...]
    #: pairs of the global batch (every micro-batch of every data-parallel rank)
    total: int
    #: target tokens of the chosen responses of the global batch
    chosen_tokens: int


@dataclass(frozen=True)
class TokenBatch:
    #: ``[microbatches, micro_batch, seq]`` token ids
    input_ids: torch.Tensor
    #: same shape; ``None``: the ids themselves (every position a target)
    labels: torch.Tensor | None = None
    #: same shape; ``None``: ``0..seq-1`` in every row
    position_ids: torch.Tensor | None = None
    #: same shape; ``None``: one sample per row
    segment_ids: torch.Tensor | None = None
    #: target tokens of the global batch; ``None``: the mean over each micro-batch's targets
    loss_tokens: int | None = None
    #: preference rows: the pair counts of this rank's micro-batches and of the global batch
    pairs: PairCounts | None = None
    #: precomputed reference log-probabilities (``preference.reference: precompute``):
    #: ``[microbatches, max pairs of a micro-batch, 2]`` (chosen, rejected) sums, in the order of the
    #: micro-batch's pairs; rows past a micro-batch's pair count are padding
    reference_logps: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = True) -> TokenBatch:
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                 for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def pin_memory(self) -> TokenBatch:
        pinned = {f.name: getattr(self, f.name).pin_memory()
                  for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **pinned)

    def stage_inputs(self, microbatch: int, *, last: bool, normalizer: float | None) -> dict[str, object]:
        """Keyword arguments of a stage's forward for ``microbatch``: the labels on the last stage,
        the packed layout when there is one (every stage builds its attention mask from it)."""
        kw: dict[str, object] = {}
        if last:
            kw["labels"] = (self.labels if self.labels is not None else self.input_ids)[microbatch]
            if normalizer is not None:
                kw["loss_normalizer"] = normalizer
        if self.position_ids is not None:
            kw["position_ids"] = self.position_ids[microbatch]
        if self.segment_ids is not None:
            kw["segment_ids"] = self.segment_ids[microbatch]
        return kw


def as_token_batch(batch: torch.Tensor | TokenBatch) -> TokenBatch:
    """A plain ``[microbatches, micro_batch, seq]`` id tensor as a :class:`TokenBatch`."""
    return batch if isinstance(batch, TokenBatch) else TokenBatch(input_ids=batch)
