"""The small Llama shapes, the all-projection LoRA settings and the adapter setter the LoRA and
QLoRA tests share.

``mqa``: one KV head, so TP=2 replicates it (m=2); ``gqa``: two KV heads, replicated at TP=4;
``heads6``: six query heads, which TP=4 pads.
"""

from __future__ import annotations

import torch

from plait.lora import LoraSettings
from plait.lora.apply import adapted
from plait.models.llama.config import LlamaConfig

SETTINGS = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"))
COMMON = dict(vocab_size=64, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, head_dim=8, tie_word_embeddings=False)
CONFIGS = {
    "mqa": LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, **COMMON),  # m=2 at TP=2
    "gqa": LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **COMMON),  # m=2 at TP=4
    "heads6": LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, **COMMON),  # padding at TP=4
}


@torch.no_grad()
def set_adapters(modules: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy the full adapters ``full`` (``{projection.lora.A|B: tensor}``) into ``modules``' adapters,
    each rank taking its slices."""
    for proj, adapter in adapted(modules):
        for which, param, spec in (("A", adapter.A, adapter.a_spec), ("B", adapter.B, adapter.b_spec)):
            value = full[f"{proj.name}.lora.{which}"]
            param.copy_(spec.shard(value) if spec is not None else value)
