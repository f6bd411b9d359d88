"""Model-agnostic building blocks: no model, no family, no distributed code.

Model families compose these (:mod:`plait.models`), and the tensor-parallel layers
(:mod:`plait.tensor_parallel`) reuse their weight-free parts, so a parallel layer never imports a model.
"""

from plait.nn.attention import AttentionCore, causal_attention, split_fused_heads
from plait.nn.lm_output import CausalLMOutput
from plait.nn.mlp import DenseMLP, GatedMLP, SwiGLU, activation
from plait.nn.norm import HeadRMSNorm, LayerNorm, RMSNorm, layer_norm, rms_norm
from plait.nn.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rotate_half

__all__ = ["AttentionCore", "CausalLMOutput", "DenseMLP", "GatedMLP", "HeadRMSNorm", "LayerNorm", "RMSNorm",
           "RotaryEmbedding", "SwiGLU", "activation", "apply_rotary", "causal_attention", "layer_norm", "rms_norm",
           "rope_inv_freq", "rotate_half", "split_fused_heads"]
