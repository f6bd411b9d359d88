"""The dense Qwen3 family as a :class:`ModelFamily`: its own config, attention and TP plan; Llama's
pipeline stage (the stage only moves the full model's submodules, whatever their attention)."""

from __future__ import annotations

from plait.models.family import ModelFamily
from plait.models.llama.parallelize import local_shapes
from plait.models.llama.pipeline_stage import LlamaStage
from plait.models.qwen3.config import Qwen3Config
from plait.models.qwen3.model import Qwen3ForCausalLM
from plait.models.qwen3.parallelize import parallelize
from plait.pipeline.trace import Unit, decoder_units


def units(config: Qwen3Config) -> list[Unit]:
    return decoder_units(config.num_hidden_layers, "Qwen3DecoderLayer")


FAMILY = ModelFamily(name="qwen3", model_types=Qwen3Config.model_types, config_cls=Qwen3Config,
                     causal_lm_cls=Qwen3ForCausalLM, parallelize=parallelize, stage_cls=LlamaStage, units=units,
                     local_shapes=local_shapes)
