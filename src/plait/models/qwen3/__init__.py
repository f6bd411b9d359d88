"""Dense Qwen3 (Hugging Face ``model_type: qwen3``): per-head q/k RMSNorm, explicit head_dim."""

from plait.models.qwen3.config import Qwen3Config
from plait.models.qwen3.model import Qwen3ForCausalLM

__all__ = ["Qwen3Config", "Qwen3ForCausalLM"]
