"""Dense Qwen3: Llama's decoder with per-head RMSNorms on q and k, applied before rotary.

No distributed code; parameter names equal Hugging Face's ``Qwen3ForCausalLM`` names
(``model.layers.N.self_attn.q_norm.weight`` of size ``head_dim``). Only the attention differs
from Llama, so only it is written here; the block, model and head are Llama's, pointed at it.
"""

from __future__ import annotations

import torch

from plait.models.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from plait.models.qwen3.config import Qwen3Config
from plait.nn.norm import HeadRMSNorm


class Qwen3Attention(LlamaAttention):
    """Llama's attention with ``q_norm``/``k_norm`` (one ``head_dim`` weight each, shared by all heads)."""

    def __init__(self, config: Qwen3Config, device=None, dtype=None) -> None:
        super().__init__(config, device=device, dtype=dtype)
        self.q_norm = HeadRMSNorm(config.head_dim, config.rms_norm_eps, device=device, dtype=dtype)
        self.k_norm = HeadRMSNorm(config.head_dim, config.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        return self.o_proj(self.core(self.q_norm(q), self.k_norm(k), v, cos, sin, mask))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Decoder plus output head (tied to the embedding when ``tie_word_embeddings``)."""

    config: Qwen3Config
    model_cls = Qwen3Model
