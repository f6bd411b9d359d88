"""What a model family provides: the interface the rest of plait builds, splits and converts through.

A family is one folder under ``plait/models/`` and one line in :mod:`plait.models.registry`.
Nothing outside the folder names the family's classes: the builder (:mod:`plait.materialize`),
the pipeline partitioner, the Hugging Face reader/writer and the recipe checks all go through a
:class:`ModelFamily` found from the config (``config.family``) or from a ``config.json``'s
``model_type``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from plait.models.decoder.config import DecoderConfig
from plait.models.decoder.shapes import LocalShapes
from plait.pipeline.trace import Unit


def same_name(name: str, config: DecoderConfig) -> str:
    """The identity name mapping: plait's parameter names are Hugging Face's."""
    return name


def config_of(module: nn.Module) -> DecoderConfig:
    """The config of a family's model or pipeline stage (its plain ``config`` attribute, which
    torch's ``Module.__getattr__`` types as ``Tensor | Module``); every family's config derives
    from :class:`DecoderConfig`."""
    config = module.config
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"{type(module).__name__}.config is a {type(config).__name__}, not a model family's config")
    return config


@dataclass(frozen=True)
class ModelFamily:
    """One model family.

    ``name``: the registry key and the recipe's ``model.family`` value.
    ``model_types``: the Hugging Face ``config.json`` ``model_type`` values it reads.
    ``config_cls``: its config dataclass, derived from :class:`DecoderConfig` (Hugging Face field
    names, ``from_hf_dict``/``to_hf_dict``, ``validate``, ``num_parameters``).
    ``causal_lm_cls``: the full model, ``cls(config, device=, dtype=)``, without distributed code;
    ``forward(ids, labels=None)`` gives logits or the mean next-token loss.
    ``parallelize``: its tensor-parallel plan, ``fn(model, mesh, *, sequence_parallel, rng)``.
    ``stage_cls``: a pipeline stage cut from a full model, ``cls(full, layer_ids, first=, last=)``.
    ``units``: the pipeline units of ``config`` in execution order (what a stage boundary may cut
    between), without building a model.
    ``local_shapes``: ``fn(config, tp, kv_replication)``, the per-rank widths ``parallelize``
    builds on a mesh of those degrees (``kv_replication`` 1: the plan's automatic factor), from the
    config alone: what the planner (:mod:`plait.plan`) prices.
    ``hf_name``: ``fn(plait name, config)`` -> Hugging Face tensor name (the identity for families
    whose plait names are Hugging Face's; DeepSeek-V3 numbers its prediction modules after the
    config's layers).
    ``hf_buffers``: regular expressions of buffer names (plait's) that are checkpoint tensors, read
    and written with the parameters (DeepSeek-V3's router balancing biases).
    ``hf_ignored``: regular expressions of checkpoint tensor names that are not parameters (buffers
    an older checkpoint carries, such as GPT-NeoX's causal-mask ``attention.bias``), skipped when
    reading and converting; rotary ``inv_freq`` tables are skipped for every family.
    ``fit_to_checkpoint``: ``fn(config, tensor names, directory)`` -> the config of what a Hugging Face
    directory really holds, when its ``config.json`` may promise more (transformers writes
    DeepSeek-V3's ``num_nextn_predict_layers`` but saves no prediction modules); ``None``: the
    config is taken as written.
    ``recipes``: ready recipe files shipped with the family.
    """

    name: str
    model_types: tuple[str, ...]
    config_cls: type[DecoderConfig]
    causal_lm_cls: type[nn.Module]
    parallelize: Callable[..., nn.Module]
    stage_cls: type[nn.Module]
    units: Callable[[Any], list[Unit]]
    local_shapes: Callable[[Any, int, int], LocalShapes]
    hf_name: Callable[[str, DecoderConfig], str] = same_name
    hf_buffers: tuple[str, ...] = field(default=())
    hf_ignored: tuple[str, ...] = field(default=())
    fit_to_checkpoint: Callable[[Any, frozenset[str], Path], Any] | None = None
    recipes: tuple[Path, ...] = field(default=())
