"""Qwen3-MoE: Qwen3's attention with sparse MoE blocks (and optional dense ones).

No distributed code; parameter names equal the ones Hugging Face writes for
``Qwen3MoeForCausalLM`` (``model.layers.N.mlp.gate.weight``,
``model.layers.N.mlp.experts.E.gate_proj.weight``; a dense layer's ``model.layers.N.mlp.gate_proj.weight``).
"""

from __future__ import annotations

from torch import nn

from plait.models.llama.model import LlamaForCausalLM, LlamaMLP
from plait.models.mixtral.model import MoEDecoderLayer, MoEModel
from plait.models.qwen3.model import Qwen3Attention
from plait.models.qwen3_moe.config import Qwen3MoeConfig
from plait.nn.moe import ExpertMLP, MoELayer, SoftmaxTopKRouter


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention
    ffn_name = "mlp"

    def build_ffn(self, config: Qwen3MoeConfig, layer_id: int, device=None, dtype=None) -> nn.Module:
        if not config.is_moe_layer(layer_id):
            return LlamaMLP(config, device=device, dtype=dtype)
        router = SoftmaxTopKRouter(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                   renormalize=config.norm_topk_prob, device=device, dtype=dtype)
        return MoELayer(config.hidden_size, config.num_experts, config.moe_intermediate_size, router,
                        expert_cls=ExpertMLP, device=device, dtype=dtype)


class Qwen3MoeModel(MoEModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    config: Qwen3MoeConfig
    model_cls = Qwen3MoeModel
