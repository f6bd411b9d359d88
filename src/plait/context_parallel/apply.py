"""The context-parallel plan: applied to a rank's built stages after the tensor-parallel plan and the
pipeline split (like activation checkpointing), it touches no parameter and changes no name.

* every attention core computes attention over the cp group: the plain core
  (:class:`plait.nn.attention.AttentionCore`) through its ``context_parallel`` hook, the
  tensor-parallel core (:class:`plait.tensor_parallel.attention.ParallelAttentionCore`) through its
  ``attention_fn`` (the local heads of a TP rank, so cp composes with TP, SP and KV replication);
* the last stage's output module becomes :class:`~plait.context_parallel.sequence_loss.ContextParallelOutput`
  (pre-shifted labels, loss summed over cp; without labels it returns the logits as before).

Generation (whole prompts on every rank) runs inside :func:`whole_sequences`.

It refuses what the ring cannot compute: attention dropout, and a sliding window shorter than the
sequence (both are refused earlier, naming the recipe field, by :mod:`plait.context_parallel.rules`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from torch import nn

from plait.comm.primitives import GroupInfo
from plait.context_parallel.attention import ContextParallel, ContextParallelAttention
from plait.context_parallel.sequence_loss import ContextParallelOutput
from plait.nn.attention import AttentionCore, causal_attention
from plait.nn.lm_output import CausalLMOutput
from plait.tensor_parallel.attention import ParallelAttentionCore
from plait.tensor_parallel.vocab_parallel_output import VocabParallelCausalLMOutput


def _plain_causal(fn) -> bool:
    """``fn`` computes plain causal attention at ``seq_len`` (no window, or one covering the sequence)."""
    return fn is causal_attention


def _window_of(fn) -> int | None:
    if isinstance(fn, partial) and fn.func is causal_attention and set(fn.keywords) <= {"window"} and not fn.args:
        return fn.keywords.get("window")
    return None


def _check_core(name: str, dropout: float, window: int | None, seq_len: int) -> None:
    if dropout:
        raise ValueError(f"{name}: attention dropout {dropout} is not supported with context parallelism")
    if window is not None and window < seq_len:
        raise ValueError(f"{name}: a sliding window of {window} < seq_len={seq_len} is not supported with "
                         f"context parallelism")


def apply_context_parallel(stages: list[nn.Module], cp: ContextParallel, seq_len: int) -> list[nn.Module]:
    """Switch ``stages`` (this rank's, already built) to attention and loss over ``cp``; in place."""
    if cp.size == 1:
        return stages
    fn = ContextParallelAttention(cp)
    for stage in stages:
        for name, module in stage.named_modules():
            if isinstance(module, AttentionCore):
                _check_core(name, module.dropout, module.window, seq_len)
                module.context_parallel = fn
            elif isinstance(module, ParallelAttentionCore):
                window = _window_of(module.attention_fn)
                if not _plain_causal(module.attention_fn) and window is None:
                    raise ValueError(f"{name}: attention function {module.attention_fn!r} has no "
                                     f"context-parallel form")
                _check_core(name, module.dropout, window, seq_len)
                module.attention_fn = fn
        output = getattr(stage, "output", None)
        if isinstance(output, VocabParallelCausalLMOutput):
            stage.output = ContextParallelOutput(output.vocab_size, output.tp, cp.info, output.ignore_index)
        elif isinstance(output, CausalLMOutput):
            stage.output = ContextParallelOutput(output.vocab_size, GroupInfo.single(), cp.info, output.ignore_index)
    return stages


@contextmanager
def whole_sequences(stages: list[nn.Module]) -> Iterator[None]:
    """Within the block every rank holds whole sequences (attention is local causal attention), for
    generation: each cp rank runs the same prompt and gets the same tokens. Outside it, cp as applied."""
    fns = {id(f): f for stage in stages for m in stage.modules()
           for f in (getattr(m, "context_parallel", None), getattr(m, "attention_fn", None))
           if isinstance(f, ContextParallelAttention)}
    for f in fns.values():
        f.active = False
    try:
        yield
    finally:
        for f in fns.values():
            f.active = True
