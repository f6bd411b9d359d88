"""A rollout batch: prompts and their sampled completions laid out as a training batch.

GRPO trains on what the policy just generated. Each of this rank's ``P`` prompts has ``G``
completions, scored by a reward; this module turns them into what the pipeline runtime and the
GRPO head consume, with no communication:

* ``[microbatches, micro_batch, seq_len]`` token ids (prompt, completion, padding to ``seq_len``)
  and labels (the completion tokens; ``-100`` on the prompt and the padding), a group's ``G``
  sequences consecutive and never split over micro-batches;
* ``targets``: ``[microbatches, micro_batch, seq_len]``, 1 where position ``t`` predicts a
  completion token (``labels[t + 1]``), aligned with
  :func:`plait.post_training.logprobs.token_logprobs`' output;
* the advantages ``[microbatches, micro_batch]`` (:func:`plait.post_training.grpo_loss.group_advantages`)
  and which groups were kept (``dapo`` drops the groups whose rewards are all equal: their rows'
  targets are zeroed).

A completion keeps its end-of-sequence token when it has one (the policy learns to stop); one cut
by the token budget has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from plait.post_training.grpo_loss import group_advantages

IGNORE = -100


@dataclass(frozen=True)
class RolloutBatch:
    """One rank's rollout as training tensors (CPU; see the module doc for the shapes)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    targets: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor  # [P, G]
    kept_groups: torch.Tensor  # [P] bool

    @property
    def kept_sequences(self) -> int:
        return int(self.kept_groups.sum()) * self.rewards.shape[1]

    @property
    def kept_tokens(self) -> int:
        return int(self.targets.sum())


def rollout_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], rewards: Sequence[float],
                  *, group_size: int, variant: str, microbatches: int, micro_batch_size: int, seq_len: int,
                  pad_id: int = 0) -> RolloutBatch:
    """Lay out ``P`` prompts with ``G = group_size`` completions each (``completions`` and
    ``rewards`` in prompt-major order: prompt ``p``'s ``g``-th at ``p * G + g``)."""
    p, g = len(prompts), group_size
    n = p * g
    if len(completions) != n or len(rewards) != n:
        raise ValueError(f"{p} prompts x group_size {g} = {n} completions and rewards expected; got "
                         f"{len(completions)} and {len(rewards)}")
    if microbatches * micro_batch_size != n:
        raise ValueError(f"{n} sequences do not fill {microbatches} micro-batches of {micro_batch_size}")
    ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    targets = torch.zeros((n, seq_len), dtype=torch.float32)
    for i, completion in enumerate(completions):
        prompt = prompts[i // g]
        length = len(prompt) + len(completion)
        if length > seq_len:
            raise ValueError(f"prompt {i // g} ({len(prompt)} tokens) with a completion of {len(completion)} tokens "
                             f"exceeds seq_len={seq_len}")
        ids[i, :length] = torch.tensor([*prompt, *completion], dtype=torch.long)
        labels[i, len(prompt):length] = torch.tensor(list(completion), dtype=torch.long)
        if completion:  # position t predicts token t + 1: the completion is predicted from t = len(prompt) - 1 on
            targets[i, len(prompt) - 1:length - 1] = 1.0
    scores = torch.tensor(list(rewards), dtype=torch.float64).view(p, g)
    advantages, kept = group_advantages(scores, variant)
    targets = targets * kept.repeat_interleave(g).to(targets.dtype)[:, None]
    shape = (microbatches, micro_batch_size)
    return RolloutBatch(input_ids=ids.view(*shape, seq_len), labels=labels.view(*shape, seq_len),
                        targets=targets.view(*shape, seq_len), advantages=advantages.reshape(shape).float(),
                        rewards=scores, kept_groups=kept)


def completion_seed(run_seed: int, rollout: int, prompt_position: int, group_size: int, member: int) -> int:
    """The sampling seed of one completion: the ``member``-th of the prompt at position
    ``prompt_position`` of rollout ``rollout`` (positions count over the *global* rollout batch), so
    a completion draws the same tokens whichever rank, batch or layout decodes it."""
    return ((run_seed * 1_000_003 + rollout) * 1_000_033 + prompt_position * group_size + member) % (2**62)


__all__ = ["IGNORE", "RolloutBatch", "completion_seed", "rollout_batch"]
