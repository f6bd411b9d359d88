"""Mistral (Hugging Face ``model_type: mistral``): Llama with sliding-window attention."""

from plait.models.mistral.config import MistralConfig
from plait.models.mistral.model import MistralForCausalLM

__all__ = ["MistralConfig", "MistralForCausalLM"]
