"""Qwen3-MoE (Hugging Face ``model_type: qwen3_moe``): Qwen3's block with sparse MoE MLPs."""

from plait.models.qwen3_moe.config import Qwen3MoeConfig
from plait.models.qwen3_moe.model import Qwen3MoeForCausalLM

__all__ = ["Qwen3MoeConfig", "Qwen3MoeForCausalLM"]
