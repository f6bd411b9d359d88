"""The Llama family (Llama 2/3/3.1, SmolLM2, and Qwen2-style q/k/v biases) as a :class:`ModelFamily`."""

from __future__ import annotations

from pathlib import Path

from plait.models.family import ModelFamily
from plait.models.llama.config import LlamaConfig
from plait.models.llama.model import LlamaForCausalLM
from plait.models.llama.parallelize import local_shapes, parallelize
from plait.models.llama.pipeline_stage import LlamaStage
from plait.pipeline.trace import Unit, decoder_units

_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def units(config: LlamaConfig) -> list[Unit]:
    return decoder_units(config.num_hidden_layers, "LlamaDecoderLayer")


FAMILY = ModelFamily(
    name="llama", model_types=LlamaConfig.model_types, config_cls=LlamaConfig, causal_lm_cls=LlamaForCausalLM,
    parallelize=parallelize, stage_cls=LlamaStage, units=units, local_shapes=local_shapes,
    recipes=tuple(_RECIPES / f"{n}.yaml" for n in ("llama3-8b", "llama3-70b", "llama3-405b", "smollm2-135m-finetune")),
)
