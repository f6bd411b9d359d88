"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2-style biases)."""

from plait.models.llama.config import LlamaConfig
from plait.models.llama.model import LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM"]
