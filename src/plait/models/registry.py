"""The model families plait runs, keyed by name and by Hugging Face ``model_type``.

Adding a family: write its folder (config, model, parallelize, family) and add one line to
``_FAMILIES`` below. Everything else (recipes' ``model.family``, ``config.json`` reading, building,
pipeline splitting, conversion) finds it here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from plait.models.decoder.config import DecoderConfig
from plait.models.deepseek_v3.family import FAMILY as DEEPSEEK_V3
from plait.models.errors import ModelConfigError
from plait.models.family import ModelFamily
from plait.models.gemma3.family import FAMILY as GEMMA3
from plait.models.gpt_neox.family import FAMILY as GPT_NEOX
from plait.models.hf_files import has_weights, weight_map
from plait.models.llama.family import FAMILY as LLAMA
from plait.models.mistral.family import FAMILY as MISTRAL
from plait.models.mixtral.family import FAMILY as MIXTRAL
from plait.models.qwen3.family import FAMILY as QWEN3
from plait.models.qwen3_moe.family import FAMILY as QWEN3_MOE

_FAMILIES = (
    LLAMA,
    QWEN3,
    MISTRAL,
    MIXTRAL,
    QWEN3_MOE,
    GPT_NEOX,
    GEMMA3,
    DEEPSEEK_V3,
)

#: ``{family name: ModelFamily}``, read-only
FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({f.name: f for f in _FAMILIES})
#: ``{Hugging Face model_type: ModelFamily}``, read-only
BY_MODEL_TYPE: Mapping[str, ModelFamily] = MappingProxyType({t: f for f in _FAMILIES for t in f.model_types})
#: the default family of a recipe
DEFAULT_FAMILY = LLAMA.name


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; a :class:`ModelConfigError` naming the valid ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ModelConfigError(f"model.family={name!r} is not a model family; valid: "
                               f"{', '.join(map(repr, FAMILIES))}") from None


def family_of(config: DecoderConfig) -> ModelFamily:
    """The family of a model config object (its class's ``family`` name)."""
    return get_family(type(config).family)


def family_for_model_type(model_type: Any) -> ModelFamily:
    """The family reading ``config.json`` files of ``model_type``; raises naming the supported types."""
    supported = ", ".join(map(repr, BY_MODEL_TYPE))
    if model_type is None:
        raise ModelConfigError(f"has no model_type; plait reads configs of model_type {supported}; add "
                               f"\"model_type\": \"llama\" if this is a Llama model")
    family = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ModelConfigError(f"model_type {model_type!r} is not supported; plait runs models of model_type "
                               f"{supported}")
    return family


def config_from_hf_dict(d: dict[str, Any]) -> Any:
    """The config a ``config.json`` mapping describes, of the family its ``model_type`` names."""
    return family_for_model_type(d.get("model_type")).config_cls.from_hf_dict(d)


def fitted_to_checkpoint(config: DecoderConfig, directory: str | os.PathLike[str]) -> DecoderConfig:
    """``config`` (read from ``directory``'s ``config.json``) as its family fits it to the tensors
    the directory holds (:attr:`ModelFamily.fit_to_checkpoint`); unchanged without weights there."""
    fit = family_of(config).fit_to_checkpoint
    if fit is None or not has_weights(Path(directory)):
        return config
    fitted: DecoderConfig = fit(config, frozenset(weight_map(Path(directory))), Path(directory))
    return fitted


def read_hf_config_file(path: str | os.PathLike[str]) -> DecoderConfig:
    """The config in a Hugging Face directory's ``config.json``; errors name the file."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: it has no config.json")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ModelConfigError("does not hold a JSON object")
        return fitted_to_checkpoint(config_from_hf_dict(data), path)
    except (ValueError, UnicodeDecodeError) as e:  # ModelConfigError, bad JSON: name the file
        raise ModelConfigError(f"{file}: {e}") from None
