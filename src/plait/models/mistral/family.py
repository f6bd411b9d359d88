"""The Mistral family as a :class:`ModelFamily`: its own config, windowed attention and TP plan;
Llama's pipeline stage."""

from __future__ import annotations

from plait.models.family import ModelFamily
from plait.models.llama.parallelize import local_shapes
from plait.models.llama.pipeline_stage import LlamaStage
from plait.models.mistral.config import MistralConfig
from plait.models.mistral.model import MistralForCausalLM
from plait.models.mistral.parallelize import parallelize
from plait.pipeline.trace import Unit, decoder_units


def units(config: MistralConfig) -> list[Unit]:
    return decoder_units(config.num_hidden_layers, "MistralDecoderLayer")


FAMILY = ModelFamily(name="mistral", model_types=MistralConfig.model_types, config_cls=MistralConfig,
                     causal_lm_cls=MistralForCausalLM, parallelize=parallelize, stage_cls=LlamaStage, units=units,
                     local_shapes=local_shapes)
