"""The decoder block the planner's per-layer parameter counts describe: Llama's.

:mod:`plait.plan.memory` and :mod:`plait.plan.moe` count a block's parameters from its config:
q/k/v and output projections with Llama's optional biases, a gated MLP with its optional biases
(or a family's MoE layer), two RMSNorms, and what a family adds to that block (Qwen3's q/k norms,
found from its exact ``layer_parameters``). Every shipped family builds on that block; the local
widths come from the family itself (``ModelFamily.local_shapes``).
"""

from __future__ import annotations

from plait.models.decoder.config import DecoderConfig
from plait.models.llama.config import LlamaConfig


def llama_block(config: DecoderConfig) -> LlamaConfig:
    """``config`` as the Llama-family config whose block the counts price; a family of another block
    is refused by name (its counts are not written yet) rather than priced as a Llama."""
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"plait.plan prices Llama's decoder block; model family {type(config).family!r} "
                         f"({type(config).__name__}) has another, which the planner cannot price yet")
    return config


__all__ = ["llama_block"]
