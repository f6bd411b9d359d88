"""Mixture-of-Experts training: the recipe's ``moe`` section and how it reaches the layers
(:mod:`plait.nn.moe` holds the model-agnostic layer itself; its recipe rules are
:mod:`plait.config.rules.moe`)."""

from plait.moe.model_config import is_moe_config
from plait.moe.section import MoeSection
from plait.moe.wiring import configure_moe, moe_layers, read_moe_stats

__all__ = ["MoeSection", "configure_moe", "is_moe_config", "moe_layers", "read_moe_stats"]
