"""The Gemma 3 text family as a :class:`ModelFamily`: its own config, model, TP plan and stage;
Llama's widths (the plan places heads, MLP and vocabulary as Llama's does)."""

from __future__ import annotations

from pathlib import Path

from plait.models.family import ModelFamily
from plait.models.gemma3.config import Gemma3Config
from plait.models.gemma3.model import Gemma3ForCausalLM
from plait.models.gemma3.parallelize import local_shapes, parallelize
from plait.models.gemma3.pipeline_stage import Gemma3Stage
from plait.pipeline.trace import Unit

_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def units(config: Gemma3Config) -> list[Unit]:
    """What :func:`plait.pipeline.trace.trace_units` finds in :class:`Gemma3ForCausalLM`."""
    return ([Unit("model.embed_tokens", "embedding", "Embedding"),
             Unit("model.rotary_emb", "other", "LayerRotaryEmbeddings")]
            + [Unit(f"model.layers.{i}", "block", "Gemma3DecoderLayer") for i in range(config.num_hidden_layers)]
            + [Unit("model.norm", "norm", "OffsetRMSNorm"), Unit("lm_head", "head", "Linear")])


FAMILY = ModelFamily(name="gemma3", model_types=Gemma3Config.model_types, config_cls=Gemma3Config,
                     causal_lm_cls=Gemma3ForCausalLM, parallelize=parallelize, stage_cls=Gemma3Stage, units=units,
                     local_shapes=local_shapes, recipes=(_RECIPES / "gemma3-1b.yaml",))
