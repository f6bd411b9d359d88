"""Mixture-of-Experts training: the recipe's ``moe`` section, its rules and how it reaches the
layers (:mod:`plait.nn.moe` holds the model-agnostic layer itself)."""

from plait.moe.recipe_rules import is_moe_config, moe_problems
from plait.moe.section import MoeSection
from plait.moe.wiring import configure_moe, moe_layers, read_moe_stats

__all__ = ["MoeSection", "configure_moe", "is_moe_config", "moe_layers", "moe_problems", "read_moe_stats"]
