"""Model-agnostic building blocks: no model, no family, no distributed code.

Model families compose these (:mod:`plait.models`), and the tensor-parallel layers
(:mod:`plait.tensor_parallel`) reuse their weight-free parts, so a parallel layer never imports a model.
"""

from plait.nn.attention import AttentionCore, causal_attention
from plait.nn.lm_output import CausalLMOutput
from plait.nn.mlp import GatedMLP, SwiGLU
from plait.nn.norm import HeadRMSNorm, RMSNorm, rms_norm
from plait.nn.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rotate_half

__all__ = ["AttentionCore", "CausalLMOutput", "GatedMLP", "HeadRMSNorm", "RMSNorm", "RotaryEmbedding",
           "SwiGLU", "apply_rotary", "causal_attention", "rms_norm", "rope_inv_freq", "rotate_half"]
