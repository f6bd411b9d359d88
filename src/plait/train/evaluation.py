"""Validation loss: one definition of the evaluated sequences and one reduction for every layout.

A validation loss is comparable across runs only if it scores the same sequences the same way.
So the evaluated set depends on the recipe's global batch and ``train.eval_batches`` alone:
the first ``eval_batches`` global batches of the validation split (``eval_batches x
global_batch_size`` sequences in file order; fewer whole batches when the split is shorter, and
one batch wrapping around the split when it is shorter than a global batch). Each global batch
is cut like a training batch: data-parallel rank ``r`` takes the ``r``-th contiguous share of
``microbatches x micro_batch_size`` sequences and runs it as ``microbatches`` micro-batches
(forward only, through the same runtime as training, for every layout).

The loss is the exact token mean: every rank adds (sum of its token losses, its token count) in
float64; the pair is summed over the pipeline group (only the last stage holds a loss) and the
data-parallel group, then divided. TP ranks compute the same full loss and are not reduced.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.comm.primitives import GroupInfo
from plait.data.batch import TokenBatch
from plait.data.prompt_prepare import PromptDataset
from plait.data.sft_prepare import RowDataset
from plait.post_training.head import PreferenceHead

if TYPE_CHECKING:
    from plait.pipeline.runtime import PipelineRuntime
    from plait.train.run_state import Dataset


def validation_indices(num_sequences: int, global_batch: int, batches: int) -> list[int]:
    """Indices of the evaluated validation sequences, global batch after global batch (layout-free)."""
    if num_sequences <= 0:
        return []
    whole = max(1, min(batches, num_sequences // global_batch))
    return [i % num_sequences for i in range(whole * global_batch)]


def rank_batches(dataset: Dataset, *, global_batch: int, batches: int, microbatches: int, micro_batch_size: int,
                 dp: GroupInfo) -> Iterator[torch.Tensor | TokenBatch]:
    """This DP rank's share of each evaluated global batch, ``[microbatches, micro_batch_size, seq]``."""
    share = microbatches * micro_batch_size
    assert share * dp.size == global_batch, (share, dp.size, global_batch)
    indices = validation_indices(len(dataset), global_batch, batches)
    for start in range(0, len(indices), global_batch):
        mine = indices[start + dp.rank * share:start + (dp.rank + 1) * share]
        if isinstance(dataset, RowDataset):
            yield dataset.token_batch(mine, indices[start:start + global_batch], microbatches)
        else:
            assert not isinstance(dataset, PromptDataset), "GRPO's prompts are evaluated by their own objective"
            yield torch.stack([dataset[j] for j in mine]).view(microbatches, micro_batch_size, -1)


def counted_tokens(ids: torch.Tensor) -> int:
    """Tokens scored in ``ids`` (``[..., seq]``): every position but the last, whose label is past the end."""
    return ids[..., :-1].numel()


def local_loss_sum(loss: torch.Tensor, batch: torch.Tensor | TokenBatch, dp_size: int) -> tuple[torch.Tensor, float]:
    """(sum of this rank's token losses, its target count) from ``runtime.run``'s value on the last stage.

    Plain ids: the runtime returns the mean of equal-sized micro-batch means, so times the tokens it
    is the sum. Fine-tuning rows: it returns the local sum divided by ``loss_tokens / dp`` (the
    global normalisation of :meth:`PipelineRuntime.loss_normalizer`)."""
    if isinstance(batch, TokenBatch):
        assert batch.loss_tokens is not None and batch.labels is not None, "rows carry labels and a target count"
        local = float((batch.labels[..., 1:] != -100).sum())
        return loss.detach().double() * (max(batch.loss_tokens, 1) / dp_size), local
    tokens = counted_tokens(batch)
    return loss.detach().double() * tokens, float(tokens)


def mean_token_loss(totals: torch.Tensor, *groups: GroupInfo | None) -> float:
    """``totals`` = (sum of token losses, token count), float64, summed over ``groups`` then divided."""
    for g in groups:
        if g is not None and g.size > 1:
            dist.all_reduce(totals, group=g.group)
    loss, count = totals.tolist()
    return loss / count if count > 0 else math.nan


@torch.no_grad()
def evaluate(runtime: PipelineRuntime, dataset: Dataset, *, global_batch: int, batches: int, microbatches: int,
             micro_batch_size: int, dp: GroupInfo, pp: GroupInfo) -> float:
    """Validation loss through the rank's schedule (forward only; one stage without pipeline
    parallelism); see the module docstring.

    ``runtime.run`` returns the mean of the micro-batch mean losses on the last stage (zero
    elsewhere); micro-batches hold equal token counts, so times the batch's tokens it is the
    token-loss sum. Only the last stage counts tokens, so the PP sum counts each batch once.
    """
    device = runtime.device
    last = any(stage.last for stage in runtime.stages)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in rank_batches(dataset, global_batch=global_batch, batches=batches, microbatches=microbatches,
                              micro_batch_size=micro_batch_size, dp=dp):
        loss = runtime.run(batch, train=False)
        if last:
            total, tokens = local_loss_sum(loss, batch, dp.size)
            totals += torch.stack([total, torch.tensor(tokens, dtype=torch.float64, device=device)])
    return mean_token_loss(totals, pp, dp)


@torch.no_grad()
def evaluate_preference(runtime: PipelineRuntime, head: PreferenceHead, dataset: Dataset, *, global_batch: int,
                        batches: int, microbatches: int, micro_batch_size: int, dp: GroupInfo,
                        pp: GroupInfo) -> dict[str, float]:
    """The preference objective on the same validation rows under every layout: ``val_loss`` (the
    per-pair loss averaged over every evaluated pair, plus the SFT term over their chosen tokens)
    and the pair metrics (``val_rewards/accuracy``, ...), read from the head's evaluation sums.
    The reference pass runs before each batch, as in training."""
    for batch in rank_batches(dataset, global_batch=global_batch, batches=batches, microbatches=microbatches,
                              micro_batch_size=micro_batch_size, dp=dp):
        runtime.run(batch, train=False)
    read = head.read("eval", pp, dp)
    return {"val_loss": read.pop("loss", math.nan), **{f"val_{name}": v for name, v in read.items()}}


__all__ = ["counted_tokens", "evaluate", "evaluate_preference", "mean_token_loss", "rank_batches",
           "validation_indices"]
