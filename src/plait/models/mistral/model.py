"""Mistral: Llama's decoder with sliding-window causal attention.

No distributed code; parameter names equal Hugging Face's ``MistralForCausalLM`` names. Only the
attention core differs (it carries the window), so only the attention is written here.
"""

from __future__ import annotations

from plait.models.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from plait.models.mistral.config import MistralConfig
from plait.nn.attention import AttentionCore


class MistralAttention(LlamaAttention):
    """Llama's attention whose core masks keys older than ``config.sliding_window`` positions."""

    def __init__(self, config: MistralConfig, device=None, dtype=None) -> None:
        super().__init__(config, device=device, dtype=dtype)
        self.core = AttentionCore(config.attention_dropout, window=config.sliding_window)


class MistralDecoderLayer(LlamaDecoderLayer):
    attention_cls = MistralAttention


class MistralModel(LlamaModel):
    layer_cls = MistralDecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    config: MistralConfig
    model_cls = MistralModel
