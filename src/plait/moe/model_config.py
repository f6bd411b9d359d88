"""What a model config (any family) says about its Mixture-of-Experts layers."""

from __future__ import annotations

from typing import Any


def is_moe_config(config: Any) -> bool:
    """Whether a model config (any family) has MoE layers."""
    return callable(getattr(config, "moe_layer_ids", None)) and bool(config.moe_layer_ids())


def num_experts(config: Any) -> int:
    """Experts per MoE layer of a config of either MoE family."""
    return int(getattr(config, "num_local_experts", None) or config.num_experts)
