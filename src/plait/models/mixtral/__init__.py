"""Mixtral (Hugging Face ``model_type: mixtral``): Mistral's block with a sparse MoE MLP."""

from plait.models.mixtral.config import MixtralConfig
from plait.models.mixtral.model import MixtralForCausalLM

__all__ = ["MixtralConfig", "MixtralForCausalLM"]
