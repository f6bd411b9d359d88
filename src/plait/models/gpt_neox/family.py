"""The GPT-NeoX family (Pythia, GPT-NeoX-20B) as a :class:`ModelFamily`: its own config, model,
tensor-parallel plan, pipeline stage and units, and the buffers old checkpoints carry."""

from __future__ import annotations

from pathlib import Path

from plait.models.family import ModelFamily
from plait.models.gpt_neox.config import GPTNeoXConfig
from plait.models.gpt_neox.model import GPTNeoXForCausalLM
from plait.models.gpt_neox.parallelize import local_shapes, parallelize
from plait.models.gpt_neox.pipeline_stage import GPTNeoXStage
from plait.pipeline.trace import Unit

_RECIPES = Path(__file__).resolve().parents[2] / "recipes"

#: tensors of released GPT-NeoX / Pythia checkpoints that are buffers, not parameters: each
#: attention's causal mask (``attention.bias``, boolean) and its fill value (``attention.masked_bias``),
#: which transformers itself skips when loading
HF_BUFFERS = (r".*\.attention\.bias$", r".*\.attention\.masked_bias$")


def units(config: GPTNeoXConfig) -> list[Unit]:
    """What :func:`plait.pipeline.trace.trace_units` finds in :class:`GPTNeoXForCausalLM`: the
    embedding, its dropout when it is on, the rotary tables, the blocks, the final norm, the head."""
    dropout = [Unit("gpt_neox.emb_dropout", "other", "Dropout")] if config.hidden_dropout > 0 else []
    return ([Unit("gpt_neox.embed_in", "embedding", "Embedding"), *dropout,
             Unit("gpt_neox.rotary_emb", "other", "RotaryEmbedding")]
            + [Unit(f"gpt_neox.layers.{i}", "block", "GPTNeoXLayer") for i in range(config.num_hidden_layers)]
            + [Unit("gpt_neox.final_layer_norm", "norm", "LayerNorm"), Unit("embed_out", "head", "Linear")])


FAMILY = ModelFamily(name="gpt_neox", model_types=GPTNeoXConfig.model_types, config_cls=GPTNeoXConfig,
                     causal_lm_cls=GPTNeoXForCausalLM, parallelize=parallelize, stage_cls=GPTNeoXStage, units=units,
                     local_shapes=local_shapes, hf_ignored=HF_BUFFERS,
                     recipes=(_RECIPES / "pythia-160m.yaml",))
