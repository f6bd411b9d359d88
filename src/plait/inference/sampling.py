"""Choosing the next token of every row: greedy, or temperature, top-k and top-p sampling.

Each row draws from its own ``torch.Generator`` on the CPU, seeded by the caller: one uniform
number per row and step, turned into a token by inverting the row's filtered distribution. So a
row's tokens depend only on its seed and its logits, not on which rows share its batch, which
device runs it, or how many ranks hold the model: tensor-parallel and pipeline ranks hold the same
full-vocabulary logits (gathered or broadcast by the model) and pick the same tokens without any
communication, and a rollout split over data-parallel ranks draws what one process would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How a token is chosen from the logits.

    ``greedy``: the argmax (first index on ties); the other fields are then unused. Otherwise a
    token is drawn from ``softmax(top_p(top_k(logits / temperature)))``: ``top_k=0`` and
    ``top_p=1`` keep every token.
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.greedy and not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r} must be > 0 (use greedy=True for argmax decoding)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be a non-negative integer (0 disables top-k)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 disables top-p)")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` with every entry below the ``k``-th largest (last dim) set to ``-inf``; ``k<=0`` keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches ``p``.

    Tokens are taken in decreasing probability until their cumulative probability is ``>= p``;
    the rest get ``-inf``. The most likely token is always kept; ``p >= 1`` keeps all.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass of the tokens ranked above
    drop_sorted = before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filtered_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``[rows, vocab]`` float32 logits after temperature, top-k and top-p (``-inf``: never drawn).

    A temperature so small that the scaled logits overflow is its limit, the argmax: such a row
    keeps only its most likely token."""
    logits = logits.float()
    scaled = logits / sampling.temperature
    overflow = (torch.isnan(scaled) | torch.isposinf(scaled)).any(dim=-1, keepdim=True)
    if bool(overflow.any()):
        argmax = torch.full_like(logits, float("-inf")).scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
        scaled = torch.where(overflow, argmax, scaled)
    return top_p_filter(top_k_filter(scaled, sampling.top_k), sampling.top_p)


def next_tokens(logits: torch.Tensor, sampling: Sampling, generators: Sequence[torch.Generator],
                rows: Sequence[int] | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` (``[rows, vocab]``), as an int64 tensor on the
    logits' device. ``generators[r]`` draws row ``r``'s number (only the rows in ``rows``, when
    given, draw: finished rows keep their generators' state; the others get the argmax)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    drawing = range(logits.shape[0]) if rows is None else rows
    u = torch.zeros(logits.shape[0], dtype=torch.float64)
    for r in drawing:
        u[r] = torch.rand((), generator=generators[r], dtype=torch.float64)
    probs = torch.softmax(filtered_logits(logits, sampling), dim=-1).double()
    cdf = torch.cumsum(probs, dim=-1)
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # the first token whose cumulative mass passes u; a token of probability 0 is never chosen
    return tokens.clamp_max(logits.shape[-1] - 1)


def row_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per row, seeded with ``seeds[r]``."""
    return [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]


__all__ = ["Sampling", "filtered_logits", "next_tokens", "row_generators", "top_k_filter", "top_p_filter"]
