"""The Mixtral family as a :class:`ModelFamily`: its config, MoE blocks and (tp=1) plan; Llama's
pipeline stage (a stage only moves the full model's blocks, whatever their MLP) and local shapes
(the MoE plan splits only what Llama's plan splits; the planner prices the whole experts)."""

from __future__ import annotations

from pathlib import Path

from plait.models.family import ModelFamily
from plait.models.llama.parallelize import local_shapes
from plait.models.llama.pipeline_stage import LlamaStage
from plait.models.mixtral.config import MixtralConfig
from plait.models.mixtral.model import MixtralForCausalLM
from plait.models.mixtral.parallelize import parallelize
from plait.pipeline.trace import Unit, decoder_units


def units(config: MixtralConfig) -> list[Unit]:
    return decoder_units(config.num_hidden_layers, "MixtralDecoderLayer")


_RECIPES = Path(__file__).resolve().parents[2] / "recipes"

FAMILY = ModelFamily(name="mixtral", model_types=MixtralConfig.model_types, config_cls=MixtralConfig,
                     causal_lm_cls=MixtralForCausalLM, parallelize=parallelize, stage_cls=LlamaStage, units=units,
                     local_shapes=local_shapes,
                     recipes=tuple(_RECIPES / f"{n}.yaml" for n in ("moe-tiny", "mixtral-8x7b")))
