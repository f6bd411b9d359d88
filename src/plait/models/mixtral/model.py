"""Mixtral: Mistral's decoder with a sparse Mixture-of-Experts MLP.

No distributed code; parameter names equal the ones Hugging Face writes for
``MixtralForCausalLM`` (``model.layers.N.block_sparse_moe.gate.weight``,
``...block_sparse_moe.experts.E.w1.weight`` for the gate projection, ``w3`` up, ``w2`` down).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plait.models.decoder.config import DecoderConfig
from plait.models.llama.config import LlamaConfig
from plait.models.llama.model import LlamaForCausalLM, LlamaModel
from plait.models.mistral.model import MistralAttention
from plait.models.mixtral.config import MixtralConfig
from plait.nn.moe import ExpertMLP, MoELayer, SoftmaxTopKRouter
from plait.nn.norm import RMSNorm


class MixtralExpert(ExpertMLP):
    names = ("w1", "w3", "w2")


class MoEDecoderLayer(nn.Module):
    """Pre-norm block whose feed-forward module (attribute ``ffn_name``) is an MoE layer or, for a
    family with dense blocks, a gated MLP (``build_ffn`` decides per layer)."""

    attention_cls: ClassVar[type[nn.Module]] = MistralAttention
    ffn_name: ClassVar[str] = "block_sparse_moe"
    pipeline_block: ClassVar[bool] = True
    _next_index: int

    def __init__(self, config: LlamaConfig, device=None, dtype=None, *, layer_id: int = 0) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = self.attention_cls(config, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        setattr(self, self.ffn_name, self.build_ffn(config, layer_id, **kw))
        self.residual_dropout = nn.Dropout(config.hidden_dropout)

    def build_ffn(self, config, layer_id: int, device=None, dtype=None) -> nn.Module:
        router = SoftmaxTopKRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                                   renormalize=True, device=device, dtype=dtype)
        return MoELayer(config.hidden_size, config.num_local_experts, config.intermediate_size, router,
                        expert_cls=MixtralExpert, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self._drop(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self._drop(getattr(self, self.ffn_name)(self.post_attention_layernorm(x)))

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        return self.residual_dropout(y) if self.residual_dropout.p > 0 else y


class MoEModel(LlamaModel):
    """Llama's model whose blocks know their index (a family may make some of them dense)."""

    layer_cls: ClassVar[type[nn.Module]] = MoEDecoderLayer

    def build_layer(self, config: DecoderConfig, layer_id: int, device=None, dtype=None) -> nn.Module:
        return self.layer_cls(config, device=device, dtype=dtype, layer_id=layer_id)


class MixtralDecoderLayer(MoEDecoderLayer):
    pass


class MixtralModel(MoEModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    config: MixtralConfig
    model_cls = MixtralModel


__all__ = ["MixtralConfig", "MixtralDecoderLayer", "MixtralExpert", "MixtralForCausalLM", "MoEDecoderLayer", "MoEModel"]
