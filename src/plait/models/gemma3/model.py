"""Gemma 3's text decoder, with no distributed code.

Parameter names equal Hugging Face's ``Gemma3ForCausalLM`` names (``model.layers.N.
pre_feedforward_layernorm.weight``, ``model.layers.N.self_attn.q_norm.weight``, ...). The block is
composed of :mod:`plait.nn` parts: offset RMSNorms (``1 + weight``, in fp32) before and after the
attention and the MLP, Llama's q/k/v/o projections with per-head offset norms on q and k, the
shared attention core (with the layer's sliding window, if any), and the gated MLP with the
GeGLU product. The softmax scale ``query_pre_attn_scalar ** -0.5`` is a factor on the queries
(:func:`plait.nn.attention.query_scale_for`), so it holds on every path the core takes.

Every block receives both rotary tables (:class:`~plait.nn.rotary.LayerRotaryEmbeddings`: the
sliding layers' base ``rope_local_base_freq``, then the full layers' ``rope_theta`` and
``rope_scaling``) and reads its own. The embedding is scaled by ``sqrt(hidden_size)`` rounded to
the embedding's dtype first, as Hugging Face does.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plait.models.decoder.config import DecoderConfig
from plait.models.decoder.model import DecoderModel
from plait.models.gemma3.config import Gemma3Config
from plait.models.llama.model import LlamaAttention, LlamaForCausalLM, LlamaModel
from plait.nn.attention import AttentionCore, query_scale_for
from plait.nn.mlp import GatedMLP
from plait.nn.norm import HeadOffsetRMSNorm, OffsetRMSNorm
from plait.nn.rotary import LayerRotaryEmbeddings, RopeSpec

#: the rotary table of each kind of layer in :class:`LayerRotaryEmbeddings`' stack
SLIDING_TABLE, FULL_TABLE = 0, 1


def rope_specs(config: Gemma3Config) -> list[RopeSpec]:
    """The rotary settings of the sliding layers, then of the full-attention layers."""
    return [RopeSpec(config.head_dim, config.rope_local_base_freq),
            RopeSpec(config.head_dim, config.rope_theta, config.rope_scaling)]


def embedding_scale(h: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """``h * sqrt(hidden_size)``, the factor first rounded to ``h``'s dtype (Hugging Face's order)."""
    return h * h.new_tensor(hidden_size ** 0.5)


class Gemma3Attention(LlamaAttention):
    """Llama's projections, offset q/k head norms, the softmax scale and the layer's window."""

    def __init__(self, config: Gemma3Config, layer_id: int, device=None, dtype=None) -> None:
        super().__init__(config, device=device, dtype=dtype)
        kw = {"device": device, "dtype": dtype}
        self.q_norm = HeadOffsetRMSNorm(config.head_dim, config.rms_norm_eps, **kw)
        self.k_norm = HeadOffsetRMSNorm(config.head_dim, config.rms_norm_eps, **kw)
        self.query_scale = query_scale_for(config.head_dim, config.softmax_scale)
        self.core = AttentionCore(config.attention_dropout, window=config.window_of(layer_id))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        return self.o_proj(self.core(q, k, v, cos, sin, mask))


class Gemma3MLP(GatedMLP):
    """The gated MLP with ``hidden_activation`` on the gate (GeGLU)."""

    def __init__(self, config: Gemma3Config, device=None, dtype=None) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, act=config.hidden_activation, device=device,
                         dtype=dtype)


class Gemma3DecoderLayer(nn.Module):
    """``x + post_attn_norm(attn(input_norm(x)))``, then ``x + post_ff_norm(mlp(pre_ff_norm(x)))``;
    ``residual_dropout`` (``config.hidden_dropout``) on each branch before its residual add."""

    pipeline_block: ClassVar[bool] = True

    def __init__(self, config: Gemma3Config, layer_id: int, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        h, eps = config.hidden_size, config.rms_norm_eps
        self.rope_table = SLIDING_TABLE if config.is_sliding(layer_id) else FULL_TABLE
        self.input_layernorm = OffsetRMSNorm(h, eps, **kw)
        self.self_attn = Gemma3Attention(config, layer_id, **kw)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps, **kw)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps, **kw)
        self.mlp = Gemma3MLP(config, **kw)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps, **kw)
        self.residual_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``cos``/``sin``: both kinds of layers' tables stacked (this layer reads its own); ``mask``: a
        packed batch's document mask."""
        cos, sin = cos[self.rope_table], sin[self.rope_table]
        a = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        x = x + self._drop(a)
        return x + self._drop(self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))))

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        return self.residual_dropout(y) if self.residual_dropout.p > 0 else y


class Gemma3Model(LlamaModel):
    """Scaled embedding, Gemma 3 blocks by index, the final offset RMSNorm, both rotary tables."""

    def __init__(self, config: Gemma3Config, device=None, dtype=None) -> None:
        DecoderModel.__init__(self, config, device=device, dtype=dtype)
        self.hidden_size = config.hidden_size
        self.rotary_emb = LayerRotaryEmbeddings(rope_specs(config), device=device)

    def build_layer(self, config: DecoderConfig, layer_id: int, device=None, dtype=None) -> nn.Module:
        assert isinstance(config, Gemma3Config)
        return Gemma3DecoderLayer(config, layer_id, device=device, dtype=dtype)

    def build_norm(self, config: DecoderConfig, device=None, dtype=None) -> nn.Module:
        assert isinstance(config, Gemma3Config)
        return OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embedding_scale(self.embedding(input_ids), self.hidden_size)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Decoder plus output head (tied to the embedding by default)."""

    config: Gemma3Config
    model_cls = Gemma3Model


__all__ = ["Gemma3Attention", "Gemma3DecoderLayer", "Gemma3ForCausalLM", "Gemma3MLP", "Gemma3Model",
           "embedding_scale", "rope_specs"]
