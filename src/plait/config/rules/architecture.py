"""The model's architecture: read from ``model.hf_path``'s config.json (and the recipe's model
fields agreeing with it) or built from the recipe's model fields."""

from __future__ import annotations

import re

from plait.config.problems import Verbatim, divisors, format_value
from plait.config.rules.checker import Checker
from plait.config.schema import ARCH_FIELDS, TRAINING_KNOBS, read_hf_config
from plait.models.decoder.config import DecoderConfig
from plait.models.errors import ModelConfigError
from plait.models.llama.config import ROPE_TYPES, rope_scaling_problems

ARCH_DEPS = tuple(f"model.{f}" for f in ARCH_FIELDS) + ("model.hf_path", "model.family")


def check_architecture(c: Checker) -> None:
    """Sets :attr:`Checker.arch` (``None`` when the architecture is invalid)."""
    c.arch = _architecture(c)


def _architecture(c: Checker) -> DecoderConfig | None:
    """The model's architecture (read from ``hf_path`` or built from the recipe); ``None`` when invalid."""
    m = c.r.model
    if not c.ok(*ARCH_DEPS):
        return None
    if m.hf_path is not None:
        try:
            config = read_hf_config(m.hf_path)
        except ModelConfigError as e:
            c.add("model.hf_path", m.hf_path, str(e))
            return None
        bad = False
        family = type(config).family
        if "family" in m.model_fields_set and m.family != family:
            c.add("model.family", m.family, f"model.hf_path's config.json (model_type "
                                            f"{config.to_hf_dict()['model_type']!r}) is a {family!r} model; "
                                            f"remove model.family or set it to {family!r}")
            bad = True
        for name, value in m.knob_values().items():
            if not hasattr(config, name):
                c.add(f"model.{name}", value, f"the {family} model of model.hf_path has no {name}; remove it")
                bad = True
            else:
                setattr(config, name, value)
        for name in sorted(m.model_fields_set & set(ARCH_FIELDS) - set(TRAINING_KNOBS)):
            mine, theirs = getattr(m, name), getattr(config, name, None)
            if mine != theirs:
                c.add(f"model.{name}", mine, f"model.hf_path's config.json sets it to {format_value(theirs)}; "
                                             f"remove it from the recipe")
                bad = True
        return None if bad else config

    start = len(c.problems)
    h, heads, kv = m.hidden_size, m.num_attention_heads, m.num_key_value_heads
    head_dim = m.head_dim
    if head_dim is None:
        if h % heads:
            c.add("model.num_attention_heads", heads,
                  f"must divide model.hidden_size={h} (valid: {divisors(h)}), or set model.head_dim")
        else:
            head_dim = h // heads
    if heads % kv:
        c.add("model.num_key_value_heads", kv,
              f"must divide model.num_attention_heads={heads} (valid: {divisors(heads)})")
    if head_dim is not None and head_dim % 2:
        where = "" if m.head_dim is not None else " (hidden_size / num_attention_heads)"
        c.add("model.head_dim", head_dim, f"head dimension{where} must be even for rotary embeddings")
    rope_types = getattr(m.config_class(), "rope_types", ROPE_TYPES)
    for message in rope_scaling_problems(m.rope_scaling, rope_types):
        c.add("model.rope_scaling", m.rope_scaling, message)
    if len(c.problems) > start:
        return None
    try:
        return m.to_model_config(m.vocab_size or 1)
    except ModelConfigError as e:  # anything the family's config rejects that the rules above missed
        _add_config_error(c, str(e))
        return None


def _add_config_error(c: Checker, message: str) -> None:
    """Report a family config's refusal under the field it names (``model.<field>=...``), else
    under ``model``."""
    match = re.match(r"model\.(\w+)=", message)
    if match and match.group(1) in type(c.r.model).model_fields:
        name = match.group(1)
        c.add(f"model.{name}", getattr(c.r.model, name), message.split("=", 1)[1].split(" ", 1)[-1])
    else:
        c.add("model", Verbatim("(architecture)"), message)
