"""Log-likelihoods of token continuations through a plait model's own forward.

What a likelihood benchmark asks of a model is two numbers per request: the summed
log-probability of a continuation after its context, and whether greedy decoding would have
produced that continuation (every continuation token is the argmax at its position). Both come
from ``model(ids)``, the forward the trainer runs, in eval mode and without gradients. That
forward returns full-vocabulary logits on every rank in every tensor-parallel layout (the
vocab-parallel output gathers them), so the code below is one path for one process and for a
TP group: every rank of the group calls it with the same requests and gets the same scores,
without talking to the others beyond the model's own collectives.

Requests are scored in batches, longest first (the first batch is the largest, so a memory
problem shows at once), right-padded: the model is causal, so padding after a row's last token
changes none of that row's logits. Under sequence parallelism the padded length is rounded up to
a multiple of the TP degree, the sequence shard's unit.

The window split of :func:`rolling_windows` is lm-eval's definition of a document's
log-likelihood ("loglikelihood_rolling"): every token predicted exactly once, each window given
as much preceding context as the model's length allows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ScoreRequest:
    """A continuation to score after its context (token ids; the context holds at least one)."""

    context: Sequence[int]
    continuation: Sequence[int]


@dataclass(frozen=True)
class Score:
    """``logprob``: the summed log-probability (nats) of the continuation's tokens;
    ``is_greedy``: every one of them is the most likely token at its position."""

    logprob: float
    is_greedy: bool


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """No dropout for the length of the block; each module's own mode comes back afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def _length_unit(model: nn.Module) -> int:
    """The multiple a batch's length must be: the TP degree under sequence parallelism, else 1."""
    if getattr(model, "sequence_parallel", False) is True:
        tp = getattr(model, "tensor_parallel", None)
        return max(int(getattr(tp, "size", 1)), 1)
    return 1


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _model_input(request: ScoreRequest, max_length: int) -> tuple[list[int], int]:
    """``(input ids, number of scored positions)``: context and continuation cut to the last
    ``max_length + 1`` tokens (a longer request loses its oldest context, as lm-eval's backends
    do), without the last token (nothing is predicted after it)."""
    if not request.context or not request.continuation:
        raise ValueError(f"a request needs a context and a continuation of at least one token each, got "
                         f"{len(request.context)} and {len(request.continuation)}")
    if len(request.continuation) > max_length:
        raise ValueError(f"a continuation of {len(request.continuation)} tokens does not fit the model's length "
                         f"({max_length}); shorten it")
    whole = [int(t) for t in (*request.context, *request.continuation)]
    return whole[-(max_length + 1):][:-1], len(request.continuation)


@torch.no_grad()
def score_continuations(model: nn.Module, requests: Sequence[ScoreRequest], *, max_length: int,
                        batch_size: int = 8) -> list[Score]:
    """The :class:`Score` of each request, in request order.

    ``model``: a plait causal LM (one process, or this rank's shard of a tensor-parallel model,
    every rank of the group calling with the same arguments); ``max_length``: the longest input
    the model reads (its ``max_position_embeddings``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    inputs = [_model_input(r, max_length) for r in requests]
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i].context) + len(requests[i].continuation)))
    scores: list[Score | None] = [None] * len(requests)
    device, unit = _device(model), _length_unit(model)
    with _eval_mode(model):
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            length = max(len(inputs[i][0]) for i in batch)
            length = -(-length // unit) * unit
            ids = torch.zeros(len(batch), length, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :len(inputs[i][0])] = torch.tensor(inputs[i][0], dtype=torch.long)
            logp = F.log_softmax(model(ids.to(device)).float(), dim=-1)
            for row, i in enumerate(batch):
                tokens, scored = inputs[i]
                positions = logp[row, len(tokens) - scored:len(tokens)]  # [scored, vocab]
                target = torch.tensor(list(requests[i].continuation), dtype=torch.long, device=positions.device)
                picked = positions.gather(-1, target[:, None])[:, 0]
                scores[i] = Score(float(picked.sum()), bool((positions.argmax(-1) == target).all()))
    assert all(s is not None for s in scores)
    return [s for s in scores if s is not None]


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[ScoreRequest]:
    """The windows that score every token of a document once: the first predicts up to
    ``max_length`` tokens after ``prefix_token`` (the start-of-text token), each later one the
    next up to ``max_length`` tokens after the ``max_length`` tokens before its last one, its
    context the part that is not predicted. The sum of their scores is the document's
    log-likelihood."""
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be at least 1")
    tokens = [int(t) for t in tokens]
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [ScoreRequest([int(prefix_token)], tokens[:first])]
    done = first
    while done < len(tokens):
        size = min(len(tokens) - done, max_length)
        end = done + size
        seen = tokens[end - max_length - 1:end - 1]  # the inputs of the last max_length predictions
        windows.append(ScoreRequest(seen[:len(seen) - (size - 1)], tokens[done:end]))
        done = end
    return windows


def score_documents(model: nn.Module, documents: Sequence[Sequence[int]], *, prefix_token: int, max_length: int,
                    batch_size: int = 8) -> list[float]:
    """The log-likelihood of each document (token ids), summed over its :func:`rolling_windows`
    (windows of every document are batched together); an empty document scores 0."""
    windows = [rolling_windows(doc, prefix_token, max_length) for doc in documents]
    flat = [w for doc in windows for w in doc]
    scores = iter(score_continuations(model, flat, max_length=max_length, batch_size=batch_size))
    return [sum((next(scores).logprob for _ in doc), 0.0) for doc in windows]


__all__ = ["Score", "ScoreRequest", "rolling_windows", "score_continuations", "score_documents"]
