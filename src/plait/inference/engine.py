"""The decoding engine: a batch of prompts through prefill, then one token per row and step.

``model`` is any plait causal LM called as ``model(ids, position_ids=, logits_to_keep=1)`` that
returns the last position's full-vocabulary logits on every rank: a family's model (one process,
or tensor-parallel, whose output gathers the vocabulary) or a rank's pipeline stages
(:class:`plait.pipeline.stages_lm.StagesCausalLM`, which passes hidden states between the stages
at every step and broadcasts the logits). Every rank holding a part of the model calls
:func:`generate_tokens` with the same arguments; the ranks then pick the same tokens
(:mod:`plait.inference.sampling`) and stop at the same step without talking to each other.

Prompts of different lengths are left-padded to the longest, with positions restarting at each
row's first real token and a mask that hides the padding (:mod:`plait.inference.kv_cache`), so a
row generates what it would alone. A row ends at an end-of-sequence id (kept in its tokens), at
a stop string (the text is cut before it) or at its token budget; the batch ends when every row
has ended, or when ``should_stop`` (a stop signal; may be a collective) says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from plait.inference.attach import decoding
from plait.inference.kv_cache import KVCache
from plait.inference.sampling import Sampling, next_tokens, row_generators

FinishReason = Literal["eos", "stop_string", "length", "stopped"]
GREEDY = Sampling(greedy=True)


@dataclass
class Completion:
    """One row's new tokens and why they ended. ``text``: the decoded tokens, cut before the stop
    string that ended them (only when the engine was given ``decode``)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    text: str | None = None


@dataclass(frozen=True)
class StopRules:
    """When a row ends: after an id of ``eos_ids``, or once its decoded text contains one of
    ``stop_strings`` (``decode`` turns token ids into text)."""

    eos_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None

    def __post_init__(self) -> None:
        if self.stop_strings and self.decode is None:
            raise ValueError("stop_strings need decode (token ids -> text) to be recognised")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop_strings={list(self.stop_strings)!r} must be non-empty strings")


def model_context(model: nn.Module) -> int | None:
    """The model's ``max_position_embeddings`` (``None`` when its config has none)."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def _window(model: nn.Module) -> int | None:
    value = getattr(getattr(model, "config", None), "sliding_window", None)
    return value if isinstance(value, int) else None


def _budgets(max_new_tokens: int | Sequence[int], rows: int) -> list[int]:
    budgets = [max_new_tokens] * rows if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != rows:
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {rows} prompts; give one per prompt or "
                         f"one int")
    for b in budgets:
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise ValueError(f"max_new_tokens={b!r} must be a non-negative integer")
    return budgets


def _check_prompts(prompts: Sequence[Sequence[int]], budgets: list[int], context: int | None,
                   vocab: int | None) -> None:
    if not prompts:
        raise ValueError("no prompts to generate from")
    for r, prompt in enumerate(prompts):
        if len(prompt) < 1:
            raise ValueError(f"prompt {r} is empty; give at least one token (e.g. the start-of-document token)")
        bad = [t for t in prompt if not 0 <= int(t) < (vocab or 2**62)]
        if bad:
            raise ValueError(f"prompt {r} holds token id {bad[0]}, outside the model's vocabulary (vocab_size={vocab})")
        if context is not None and len(prompt) + budgets[r] > context:
            raise ValueError(f"prompt {r} is {len(prompt)} tokens and asks for {budgets[r]} new ones, past the model's "
                             f"context (max_position_embeddings={context}); ask for at most "
                             f"{max(context - len(prompt), 0)} new tokens or shorten the prompt")


@torch.no_grad()
def generate_tokens(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
                    sampling: Sampling = GREEDY, seeds: int | Sequence[int] = 0,
                    stop: StopRules | None = None,
                    on_token: Callable[[int, int], None] | None = None,
                    should_stop: Callable[[], bool] | None = None, check_every: int = 16) -> list[Completion]:
    """New tokens for each prompt (token id lists), up to ``max_new_tokens`` (one int, or one per
    prompt); prompt plus budget must fit the model's ``max_position_embeddings``.

    ``seeds``: one per prompt, or one int ``s`` (prompt ``r`` then uses ``s + r``). ``on_token(row,
    token)`` is called for every new token of a row still running (e.g. to stream it).
    ``should_stop()`` is called after every ``check_every`` steps; True ends every row
    (``finish_reason="stopped"``). The model's mode and attributes are restored afterwards.
    """
    stop = stop or StopRules()
    rows = len(prompts)
    budgets = _budgets(max_new_tokens, rows)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    _check_prompts(prompts, budgets, model_context(model), vocab if isinstance(vocab, int) else None)
    seed_list = [seeds + r for r in range(rows)] if isinstance(seeds, int) else [int(s) for s in seeds]
    if len(seed_list) != rows:
        raise ValueError(f"seeds has {len(seed_list)} entries for {rows} prompts")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    length = max(len(p) for p in prompts)
    pads = torch.tensor([length - len(p) for p in prompts], dtype=torch.long)
    ids = torch.zeros(rows, length, dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids[r, length - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
    completions = [Completion() for _ in range(rows)]
    running = [b > 0 for b in budgets]
    if not any(running):
        return completions
    steps = max(budgets)
    cache = KVCache(rows, length + steps, pads, window=_window(model), device=device)
    generators = row_generators(seed_list)
    with decoding(model, cache):
        logits = _forward(model, cache, ids.to(device))
        for step in range(steps):
            live = [r for r in range(rows) if running[r]]
            tokens = next_tokens(logits, sampling, generators, live).tolist()
            for r in live:
                _append(completions[r], tokens[r], r, stop, on_token)
                if completions[r].finish_reason != "length" or len(completions[r].tokens) >= budgets[r]:
                    running[r] = False
            if not any(running):
                break
            if should_stop is not None and (step + 1) % check_every == 0 and should_stop():
                for r in range(rows):
                    if running[r]:
                        completions[r].finish_reason = "stopped"
                break
            logits = _forward(model, cache, torch.tensor(tokens, dtype=torch.long, device=device).view(rows, 1))
    if stop.decode is not None:
        for c in completions:
            if c.text is None:
                c.text = stop.decode(c.tokens)
    return completions


def _forward(model: nn.Module, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits ``[rows, vocab]`` of a forward over ``ids`` at the next slots."""
    n = ids.shape[1]
    cache.begin(n)
    logits = model(ids, position_ids=cache.positions(n), logits_to_keep=1)
    cache.advance(n)
    return logits[:, -1]


def _append(c: Completion, token: int, row: int, stop: StopRules,
            on_token: Callable[[int, int], None] | None) -> None:
    c.tokens.append(token)
    if on_token is not None:
        on_token(row, token)
    if token in stop.eos_ids:
        c.finish_reason = "eos"
        return
    if stop.stop_strings:
        assert stop.decode is not None, "StopRules refuses stop strings without decode"
        text = stop.decode(c.tokens)
        cuts = [text.find(s) for s in stop.stop_strings if s in text]
        if cuts:
            c.finish_reason, c.text = "stop_string", text[:min(cuts)]


def generate(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, greedy: bool = False, seed: int = 0,
             eos_id: int | Iterable[int] | None = None, on_token: Callable[[int], None] | None = None,
             should_stop: Callable[[], bool] | None = None, check_every: int = 16) -> torch.Tensor:
    """One prompt (``[1, n]`` ids) extended by up to ``max_new_tokens``: ``[1, n + k]``, the end-of-
    sequence token kept. A shorthand of :func:`generate_tokens` for one row (``on_token(id)``)."""
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must have shape [1, n] with n >= 1, got {list(prompt_ids.shape)}")
    if prompt_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"prompt_ids must hold integer token ids, got dtype {prompt_ids.dtype}")
    sampling = Sampling(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    stream = None if on_token is None else (lambda _row, token: on_token(token))
    done = generate_tokens(model, [prompt_ids[0].tolist()], max_new_tokens, sampling=sampling, seeds=[seed],
                           stop=StopRules(eos_ids=stop_ids(eos_id)), on_token=stream, should_stop=should_stop,
                           check_every=check_every)[0]
    new = torch.tensor([done.tokens], dtype=prompt_ids.dtype, device=prompt_ids.device).view(1, -1)
    return torch.cat([prompt_ids, new], dim=1)


def stop_ids(ids: int | Iterable[int] | None) -> frozenset[int]:
    """End-of-sequence ids as a set (``None``: none)."""
    if ids is None:
        return frozenset()
    return frozenset({int(ids)} if isinstance(ids, int) else {int(i) for i in ids})


__all__ = ["Completion", "FinishReason", "StopRules", "generate", "generate_tokens", "model_context", "stop_ids"]
