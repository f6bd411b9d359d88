"""The DeepSeek-V3 family as a :class:`ModelFamily`: its config, model, TP plan and stage; the
router's balancing biases are checkpoint tensors, and DeepSeek's copies of the embedding and head
inside its prediction modules are not read (the model's own are used)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from plait.models.deepseek_v3.config import DeepseekV3Config
from plait.models.deepseek_v3.model import DeepseekV3ForCausalLM, hf_name
from plait.models.deepseek_v3.parallelize import local_shapes, parallelize
from plait.models.deepseek_v3.pipeline_stage import DeepseekV3Stage
from plait.models.errors import ModelConfigError
from plait.models.family import ModelFamily
from plait.pipeline.trace import Unit, decoder_units

_RECIPES = Path(__file__).resolve().parents[2] / "recipes"
#: the balancing bias of every router (plait's name; ``hf_name`` maps it to ``e_score_correction_bias``)
HF_BUFFERS = (r"(model\.layers|mtp)\.\d+\.mlp\.gate\.expert_bias",)
#: DeepSeek's prediction modules store copies of the shared embedding and head
HF_IGNORED = (r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$",)


def fit_to_checkpoint(config: DeepseekV3Config, names: frozenset[str], directory: Path) -> DeepseekV3Config:
    """Without prediction modules when the checkpoint holds none of them (transformers writes
    ``num_nextn_predict_layers`` but neither builds nor saves them), saying so; all of them when it
    holds all (DeepSeek's own releases, plait's exports); refused when it holds some."""
    depth, layers = config.num_nextn_predict_layers, config.num_hidden_layers
    held = [k for k in range(depth) if any(n.startswith(f"model.layers.{layers + k}.") for n in names)]
    if len(held) == depth:
        return config
    if held:
        raise ModelConfigError(f"num_nextn_predict_layers={depth} but the checkpoint in {directory} holds "
                               f"prediction modules only at layers {[layers + k for k in held]}; set it to "
                               f"{len(held)} if the first ones are complete")
    warnings.warn(f"{directory}/config.json has num_nextn_predict_layers={depth} but the checkpoint holds no "
                  f"prediction module (model.layers.{layers}.*; transformers saves none): the model is built without "
                  f"multi-token prediction", stacklevel=2)
    return dataclasses.replace(config, num_nextn_predict_layers=0)


def units(config: DeepseekV3Config) -> list[Unit]:
    return decoder_units(config.num_hidden_layers, "DeepseekV3DecoderLayer")


FAMILY = ModelFamily(name="deepseek_v3", model_types=DeepseekV3Config.model_types, config_cls=DeepseekV3Config,
                     causal_lm_cls=DeepseekV3ForCausalLM, parallelize=parallelize, stage_cls=DeepseekV3Stage,
                     units=units, local_shapes=local_shapes, hf_name=hf_name, hf_buffers=HF_BUFFERS,
                     hf_ignored=HF_IGNORED, fit_to_checkpoint=fit_to_checkpoint,
                     recipes=(_RECIPES / "deepseek-v3.yaml",))
