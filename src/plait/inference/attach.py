"""Putting a model into decoding mode for the length of one generation, and back.

Decoding changes nothing in the model's weights or its code, only a few attributes, set here and
restored on the way out (also when generation fails):

- eval mode (no dropout);
- every attention core's ``kv_cache`` (see :mod:`plait.inference.kv_cache`): one layer cache each,
  in module order, with the core's own sliding window (its ``window``) when it has one; a
  latent-attention module's ``latent_cache`` instead (:mod:`plait.inference.latent_cache`: it
  caches the latent, and its core none);
- sequence parallelism off: a decode step has one position per row, which cannot be split over
  the tensor-parallel ranks, so every module that splits or gathers the sequence
  (``sequence_parallel`` attribute: the parallel embedding, linears, attention, MLPs, LoRA layers)
  runs as plain tensor parallelism, which computes the same values on a replicated sequence;
- Mixture-of-Experts layers dropless (``capacity_factor=None``): a capacity counts the tokens of
  one forward, and a decode step's forward holds one token per row, so a capacity would drop by a
  different ranking than a full forward does; generation keeps every assignment, as Hugging
  Face's MoE models do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from plait.inference.kv_cache import UNSET, KVCache
from plait.inference.latent_cache import LatentKVCache
from plait.nn.moe import MoELayer


def latent_attentions(model: nn.Module) -> list[nn.Module]:
    """The latent-attention modules of ``model`` (a ``latent_cache`` slot: they cache the latent, not
    their core's heads), in module order."""
    return [m for m in model.modules() if hasattr(m, "latent_cache")]


def attention_cores(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that accept a ``kv_cache`` (its attention cores), in module order,
    but for those inside a latent-attention module."""
    inside = {id(core) for m in latent_attentions(model) for core in m.modules() if core is not m}
    return [m for m in model.modules() if hasattr(m, "kv_cache") and id(m) not in inside]


@contextmanager
def decoding(model: nn.Module, cache: KVCache) -> Iterator[int]:
    """Within the block ``model`` decodes with ``cache``; yields the number of cached layers."""
    cores, latents = attention_cores(model), latent_attentions(model)
    if not cores and not latents:
        raise ValueError(f"{type(model).__name__} has no attention core with a kv_cache slot; the decoding engine "
                         f"serves plait's model families")
    saved: list[tuple[nn.Module, str, object]] = []

    def set_attr(module: nn.Module, name: str, value: object) -> None:
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    modes = [(m, m.training) for m in model.modules()]  # each module's own mode comes back
    model.eval()
    try:
        for core in cores:
            # a core that names its sliding window (a layer of its own kind: Gemma 3) keeps it
            set_attr(core, "kv_cache", cache.layer(getattr(core, "window", UNSET)))
        for module in latents:
            set_attr(module, "latent_cache", LatentKVCache(cache, cache.window))
        for module in model.modules():
            if getattr(module, "sequence_parallel", False) is True:
                set_attr(module, "sequence_parallel", False)
            if isinstance(module, MoELayer) and module.capacity_factor is not None:
                set_attr(module, "capacity_factor", None)
        yield len(cores) + len(latents)
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
        for module, mode in modes:
            module.training = mode


__all__ = ["attention_cores", "decoding", "latent_attentions"]
