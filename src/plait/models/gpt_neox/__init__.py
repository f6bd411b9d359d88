"""GPT-NeoX (Hugging Face ``model_type: gpt_neox``; EleutherAI's Pythia and GPT-NeoX-20B): layer
norms, a fused q/k/v projection, partial rotary, a GeLU MLP and the parallel residual."""

from plait.models.gpt_neox.config import GPTNeoXConfig
from plait.models.gpt_neox.model import GPTNeoXForCausalLM

__all__ = ["GPTNeoXConfig", "GPTNeoXForCausalLM"]
