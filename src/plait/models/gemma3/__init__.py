"""Gemma 3 text models (Hugging Face ``model_type: gemma3_text``): sliding and full-attention layers,
offset RMSNorms, GeGLU, a scaled embedding and softmax."""

from plait.models.gemma3.config import Gemma3Config
from plait.models.gemma3.model import Gemma3ForCausalLM

__all__ = ["Gemma3Config", "Gemma3ForCausalLM"]
