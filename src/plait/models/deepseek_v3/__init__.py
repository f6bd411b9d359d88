"""DeepSeek-V3 (Hugging Face ``model_type: deepseek_v3``): multi-head latent attention, fine-grained
MoE with shared experts and a sigmoid group-limited router, and multi-token prediction."""

from plait.models.deepseek_v3.config import DeepseekV3Config
from plait.models.deepseek_v3.model import DeepseekV3ForCausalLM

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM"]
