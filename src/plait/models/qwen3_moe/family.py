"""The Qwen3-MoE family as a :class:`ModelFamily`: its config and blocks, the MoE plan (tp=1),
Llama's pipeline stage and Llama's local shapes (as for Mixtral)."""

from __future__ import annotations

from plait.models.family import ModelFamily
from plait.models.llama.parallelize import local_shapes
from plait.models.llama.pipeline_stage import LlamaStage
from plait.models.mixtral.parallelize import parallelize
from plait.models.qwen3_moe.config import Qwen3MoeConfig
from plait.models.qwen3_moe.model import Qwen3MoeForCausalLM
from plait.pipeline.trace import Unit, decoder_units


def units(config: Qwen3MoeConfig) -> list[Unit]:
    return decoder_units(config.num_hidden_layers, "Qwen3MoeDecoderLayer")


FAMILY = ModelFamily(name="qwen3_moe", model_types=Qwen3MoeConfig.model_types, config_cls=Qwen3MoeConfig,
                     causal_lm_cls=Qwen3MoeForCausalLM, parallelize=parallelize, stage_cls=LlamaStage, units=units,
                     local_shapes=local_shapes)
