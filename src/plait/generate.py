"""Autoregressive sampling from a plait causal LM: greedy, temperature, top-k and top-p.

There is no KV cache: each new token re-runs the full forward on the sequence so far (the last
``max_position_embeddings`` tokens). That is quadratic in the length but needs nothing from the
model beyond ``model(ids) -> logits``, which also holds under tensor parallelism, where the
output module gathers the full-vocabulary logits on every rank. Each TP rank then holds the same
logits and draws from its own ``torch.Generator`` seeded identically, so all ranks pick the same
token without any communication.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from plait.comm.primitives import GroupInfo


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


def sample_next(logits: torch.Tensor, generator: torch.Generator, *, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0, greedy: bool = False) -> int:
    """One token id from a ``[vocab]`` logits vector (temperature, then top-k, then top-p)."""
    logits = logits.detach().float().cpu()
    if greedy:
        return int(torch.argmax(logits))
    scaled = logits / temperature
    if bool(torch.isnan(scaled).any() or torch.isposinf(scaled).any()):
        return int(torch.argmax(logits))  # a temperature so small the logits overflow: its limit, the argmax
    logits = top_p_filter(top_k_filter(scaled, top_k), top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _check(prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
           greedy: bool) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must have shape [1, n] with n >= 1, got {list(prompt_ids.shape)}")
    if prompt_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"prompt_ids must hold integer token ids, got dtype {prompt_ids.dtype}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative integer")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 (use greedy=True for argmax decoding)")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be a non-negative integer (0 disables top-k)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 disables top-p)")


def _sequence_multiple(model: nn.Module) -> int:
    """The multiple the context length is padded to: the TP degree when the model runs sequence
    parallelism (which splits the sequence over the TP ranks), else 1."""
    if not getattr(model, "sequence_parallel", False):
        return 1
    tp = getattr(model, "tensor_parallel", None)
    assert isinstance(tp, GroupInfo), "the tensor-parallel plan sets tensor_parallel with sequence_parallel"
    return tp.size


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, greedy: bool = False, seed: int = 0,
             eos_id: int | Iterable[int] | None = None,
             on_token: Callable[[int], None] | None = None, should_stop: Callable[[], bool] | None = None,
             check_every: int = 16) -> torch.Tensor:
    """Extend ``prompt_ids`` (``[1, n]``) by up to ``max_new_tokens`` tokens; returns ``[1, n + k]``.

    ``greedy`` takes the argmax (first index on ties); otherwise a token is drawn from
    ``softmax(top_p(top_k(logits / temperature)))`` with a CPU generator seeded by ``seed``, so a
    given seed gives the same text on every run and on every TP rank. Generation stops after a
    token in ``eos_id`` (which is kept in the output). ``on_token(id)`` is called for each new
    token, e.g. to stream text. ``should_stop()``, called after every ``check_every`` new tokens,
    ends generation early when it returns True (a stop signal; every rank of a model spread over
    processes calls it at the same tokens, so it may be a collective). The model is put in eval
    mode and restored afterwards.
    """
    _check(prompt_ids, max_new_tokens, temperature, top_k, top_p, greedy)
    stop = set() if eos_id is None else ({int(eos_id)} if isinstance(eos_id, int) else {int(i) for i in eos_id})
    param = next(model.parameters(), None)
    device = param.device if param is not None else prompt_ids.device
    max_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = prompt_ids.to(device=device, dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        # Sequence parallelism splits the sequence over the TP ranks, so the context is right-padded
        # to a multiple of the TP degree; causal attention keeps the padding from affecting the
        # last real position, whose logits are the ones read.
        multiple = _sequence_multiple(model)
        if max_len is not None:
            max_len -= max_len % multiple
        for step in range(max_new_tokens):
            context = ids if max_len is None else ids[:, -max_len:]
            n = context.shape[1]
            pad = -n % multiple
            if pad:
                context = torch.cat([context, context[:, -1:].expand(1, pad)], dim=1)
            logits = model(context)[0, n - 1]
            token = sample_next(logits, generator, temperature=temperature, top_k=top_k, top_p=top_p,
                                greedy=greedy)
            ids = torch.cat([ids, torch.tensor([[token]], device=device, dtype=torch.long)], dim=1)
            if on_token is not None:
                on_token(token)
            if token in stop:
                break
            if should_stop is not None and (step + 1) % check_every == 0 and should_stop():
                break
    finally:
        model.train(was_training)
    return ids


__all__ = ["generate", "sample_next", "top_k_filter", "top_p_filter"]
