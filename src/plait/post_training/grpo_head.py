"""The GRPO loss on the last pipeline stage: logits -> token log-probabilities -> clipped surrogate.

A :class:`GRPOHead` is the pipeline runtime's ``loss_head`` for ``train.objective: grpo``. Before
each step's schedule the rollout loader hands it the step's rollout (:meth:`GRPOHead.start_rollout`:
per-token weights built from the *global* counts, advantages); the last stage then calls the bound
loss of each micro-batch with its logits. Token log-probabilities come from the vocabulary-parallel
cross-entropy (:func:`plait.post_training.logprobs.token_logprobs`), so the vocabulary is never
gathered, under any TP degree.

Normalisation: :func:`plait.post_training.grpo_loss.policy_loss` is a weighted sum whose weights
over the whole global rollout batch give the variant's average. The runtime divides each
micro-batch's loss by the micro-batch count and data parallelism averages the gradients over
ranks, so a micro-batch returns its weighted sum times ``microbatches * dp``: the step's gradient
is then exactly that of the global batch's loss.

Two forward-only passes may run before the policy pass, each storing per-micro-batch token
log-probabilities on the last stage (:meth:`GRPOHead.collecting`): ``old`` (the policy that
sampled the rollout, when ``grpo.epochs > 1``; with one epoch the ratio is exactly 1 and the
policy's own detached values stand in) and ``reference`` (the KL reference, when
``grpo.kl_coef > 0``; the preference reference passes drive it through
:meth:`collecting_reference`).

Metrics stay on the device: token sums (counted tokens, clipped, ratio, KL, entropy) and the
loss are accumulated and read once per logging interval (:meth:`read`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.comm.primitives import GroupInfo
from plait.data.batch import TokenBatch
from plait.post_training.grpo_loss import policy_loss, token_weights
from plait.post_training.logprobs import token_logprobs

#: accumulated sums, in this order
SUMS = ("loss", "tokens", "clipped", "clipped_low", "clipped_high", "ratio", "kl", "entropy")


@dataclass(frozen=True)
class GRPOSettings:
    variant: str
    eps_low: float
    eps_high: float
    kl_coef: float
    max_completion_tokens: int


@dataclass(frozen=True)
class RolloutTensors:
    """The step's rollout as the head uses it, on the device: ``weights [M, b, s]`` (aligned with
    the token log-probabilities) and ``advantages [M, b]``."""

    weights: torch.Tensor
    advantages: torch.Tensor


def vocab_parallel_entropy(logits_local: torch.Tensor, vocab_size: int, tp: GroupInfo) -> torch.Tensor:
    """``[b, s]`` entropy of each position's next-token distribution from this rank's vocabulary
    block (``[b, s, V_local]``; the last block's columns past ``vocab_size`` are padding), without
    gathering the vocabulary: three reductions over the TP group. No gradient."""
    with torch.no_grad():
        z = logits_local.float()
        start = tp.rank * z.shape[-1]
        real = (torch.arange(z.shape[-1], device=z.device) + start) < vocab_size
        z = z.masked_fill(~real, float("-inf"))
        m = z.amax(dim=-1)
        if tp.size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = z - m.unsqueeze(-1)
        e = torch.exp(shifted)
        sums = torch.stack([e.sum(-1), torch.where(real, e * shifted, torch.zeros_like(e)).sum(-1)])
        if tp.size > 1:
            dist.all_reduce(sums, group=tp.group)
        return torch.log(sums[0]) - sums[1] / sums[0]


class GRPOHead:
    """The GRPO objective of a run, bound to micro-batches by the pipeline runtime."""

    def __init__(self, settings: GRPOSettings, *, vocab_size: int, tp: GroupInfo, microbatches: int, dp_size: int,
                 device: torch.device) -> None:
        self.settings, self.vocab_size, self.tp = settings, vocab_size, tp
        self.shards = microbatches * dp_size
        self.device = device
        self.rollout: RolloutTensors | None = None
        self._stored: dict[str, dict[int, torch.Tensor]] = {"old": {}, "reference": {}}
        self._collecting: str | None = None
        self._sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)

    # ------------------------------------------------------------------ the step's rollout
    def start_rollout(self, targets: torch.Tensor, advantages: torch.Tensor, *, num_sequences: int,
                      num_tokens: int) -> None:
        """The rollout the next steps train on: ``targets [M, b, s]`` (1 where a completion token
        is predicted), ``advantages [M, b]``, and the kept sequences and target tokens of the
        *global* batch (every rank's); drops the previous rollout's stored passes."""
        s = self.settings
        m, b, t = targets.shape
        weights = token_weights(targets.reshape(m * b, t).to(self.device), s.variant,
                                num_sequences=max(num_sequences, 1), num_tokens=max(num_tokens, 1),
                                max_completion_tokens=s.max_completion_tokens).view(m, b, t)
        self.rollout = RolloutTensors(weights=weights, advantages=advantages.to(self.device))
        for stored in self._stored.values():
            stored.clear()

    @contextlib.contextmanager
    def collecting(self, what: str) -> Iterator[None]:
        """Micro-batches bound inside store their token log-probabilities as ``what`` (``old`` or
        ``reference``) and return a zero loss."""
        assert what in self._stored, what
        self._stored[what].clear()
        self._collecting = what
        try:
            yield
        finally:
            self._collecting = None

    def collecting_reference(self) -> contextlib.AbstractContextManager[None]:
        """The reference passes' entry point (shared with the preference objectives)."""
        return self.collecting("reference")

    # ------------------------------------------------------------------ the loss
    def bind(self, tokens: TokenBatch, microbatch: int, train: bool):  # noqa: ARG002 - the runtime's signature
        """The loss the last stage computes from ``(logits, labels)`` for ``microbatch``."""
        if self._collecting is not None:
            return functools.partial(self._store, self._collecting, microbatch)
        return functools.partial(self._loss, microbatch)

    def _store(self, what: str, microbatch: int, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self._stored[what][microbatch] = token_logprobs(logits, labels, self.vocab_size, self.tp)
        return logits.new_zeros((), dtype=torch.float32)

    def _loss(self, microbatch: int, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rollout = self.rollout
        if rollout is None:
            raise RuntimeError("the GRPO head has no rollout: the rollout loader starts one before each step")
        s = self.settings
        logp = token_logprobs(logits, labels, self.vocab_size, self.tp)
        old = self._stored["old"].get(microbatch)
        ref = self._stored["reference"].pop(microbatch, None)
        if s.kl_coef > 0 and ref is None:
            raise RuntimeError(f"grpo.kl_coef={s.kl_coef}: no reference log-probabilities for micro-batch "
                               f"{microbatch}; the reference pass must run before the policy pass")
        weights = rollout.weights[microbatch]
        loss, metrics = policy_loss(logp, logp.detach() if old is None else old, rollout.advantages[microbatch],
                                    weights, eps_low=s.eps_low, eps_high=s.eps_high, kl_coef=s.kl_coef,
                                    ref_logp=ref)
        entropy = vocab_parallel_entropy(logits, self.vocab_size, self.tp)
        counted = (weights != 0).to(entropy.dtype)
        values = [loss.detach()] + [metrics.get(name, torch.zeros((), device=loss.device)) for name in SUMS[1:-1]]
        values.append((entropy * counted).sum())
        self._sums += torch.stack([v.double() for v in values])
        return loss * self.shards

    # ------------------------------------------------------------------ metrics
    def read(self, *groups: GroupInfo | None) -> dict[str, float]:
        """Means since the last read, summed over ``groups`` (the pipeline group, whose last stage
        alone adds, and the data-parallel group): one host read; then reset."""
        sums = self._sums
        self._sums = torch.zeros_like(sums)
        for g in groups:
            if g is not None and g.size > 1:
                dist.all_reduce(sums, group=g.group)
        v = dict(zip(SUMS, sums.tolist(), strict=True))
        tokens = v["tokens"]
        if tokens <= 0:
            return {}
        out = {"grpo/clip_fraction": v["clipped"] / tokens, "grpo/clip_fraction_low": v["clipped_low"] / tokens,
               "grpo/clip_fraction_high": v["clipped_high"] / tokens, "grpo/ratio": v["ratio"] / tokens,
               "grpo/entropy": v["entropy"] / tokens}
        if self.settings.kl_coef > 0:
            out["grpo/kl"] = v["kl"] / tokens
        return out


__all__ = ["SUMS", "GRPOHead", "GRPOSettings", "RolloutTensors", "vocab_parallel_entropy"]
