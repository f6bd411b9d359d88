"""Generation without a cache: every new token re-runs the model over the whole sequence so far.

Quadratic in the length and kept for two reasons: it is the reference the cached engine must
equal token for token (the exactness tests), and the benchmark's baseline (``bench/bench_generate.py``).
It needs nothing from the model beyond ``model(ids) -> logits``, and picks tokens exactly as the
engine does (:func:`plait.inference.sampling.next_tokens`, one generator per row), so with the same
seed both draw the same tokens whenever their logits agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.inference.engine import GREEDY, StopRules, model_context
from plait.inference.sampling import Sampling, next_tokens, row_generators


def _sequence_multiple(model: nn.Module) -> int:
    """The TP degree when the model runs sequence parallelism (which splits the sequence over the
    TP ranks, so the context is padded to a multiple of it), else 1."""
    if not getattr(model, "sequence_parallel", False):
        return 1
    tp = getattr(model, "tensor_parallel", None)
    assert isinstance(tp, GroupInfo), "the tensor-parallel plan sets tensor_parallel with sequence_parallel"
    return tp.size


@torch.no_grad()
def generate_uncached(model: nn.Module, prompt: Sequence[int], max_new_tokens: int, *,
                      sampling: Sampling = GREEDY, seed: int = 0,
                      stop: StopRules | None = None) -> list[int]:
    """The new tokens after ``prompt`` (one row), each from a full forward over the sequence so far
    (its last ``max_position_embeddings`` tokens). Stops after an id of ``stop.eos_ids``."""
    stop = stop or StopRules()
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    max_len = model_context(model)
    multiple = _sequence_multiple(model)
    if max_len is not None:
        max_len -= max_len % multiple
    generators = row_generators([seed])
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = ids if max_len is None else ids[:, -max_len:]
            n = context.shape[1]
            pad = -n % multiple
            if pad:  # causal attention keeps the padding from reaching the last real position
                context = torch.cat([context, context[:, -1:].expand(1, pad)], dim=1)
            logits = model(context)[:, n - 1]
            token = int(next_tokens(logits, sampling, generators)[0])
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
            if token in stop.eos_ids:
                break
    finally:
        model.train(was_training)
    return new


__all__ = ["generate_uncached"]
