"""The tensor-parallel plan of the MoE families (Mixtral, Qwen3-MoE): Llama's plan for everything
but the sparse MLPs, whose router and experts stay whole on every TP rank.

Order: Llama's plan (embedding, attention with its head layout, dense MLPs, norms, output head
and vocab-parallel loss; see :mod:`plait.models.llama.parallelize`), then each sparse block's
MoE layer put back where the plan had swapped in a dense parallel MLP.

Why whole experts: without sequence parallelism the MoE layer's input (the attention block's
all-reduced output, normalised) is the same on every TP rank, so each rank routes the same tokens
to the same experts and computes the same output; the layer's parameters are replicated like a
norm weight (identical gradients, counted once in the norm and written once by the checkpoint,
both by their missing shard spec). The experts' work is repeated on the ``tp`` ranks: the
choice trades that compute for no TP communication in the MoE layer. With sequence parallelism
each rank routes and computes only its sequence shard (no repeated work); the builder then sums
the layer's parameter gradients over the TP group and the trainer sums the routing counts of the
load-balancing loss over it (:mod:`plait.moe.sequence_parallel`).
"""

from __future__ import annotations

from functools import partial

from torch import nn

from plait.mesh import ParallelMesh
from plait.models.llama.model import LlamaForCausalLM
from plait.models.llama.parallelize import parallelize as parallelize_llama
from plait.nn.attention import causal_attention
from plait.nn.moe import MoELayer
from plait.tensor_parallel import TensorParallelRNG


def parallelize(model: LlamaForCausalLM, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                rng: TensorParallelRNG | None = None) -> LlamaForCausalLM:
    """Swap in tensor-parallel modules for ``mesh``'s TP group on a model on the meta device, in
    place; returns the model."""
    if next(model.parameters()).device.type != "meta":
        raise ValueError("the MoE tensor-parallel plan applies to a model on the meta device (plait.materialize "
                         "builds one); build the model with plait.materialize.build_model")
    blocks: list[nn.Module] = list(model.model.layers)
    kept = []
    for block in blocks:
        name = str(block.ffn_name)
        ffn = getattr(block, name)
        kept.append((name, ffn if isinstance(ffn, MoELayer) else None))
    parallelize_llama(model, mesh, sequence_parallel=sequence_parallel, rng=rng,
                      qk_norm=hasattr(blocks[0].self_attn, "q_norm"), attention_fn=attention_fn_of(model))
    for block, (name, moe) in zip(blocks, kept, strict=True):
        if moe is None:
            continue  # a dense block: Llama's plan gave it a parallel MLP under ``mlp``
        if name != "mlp":
            del block.mlp  # the plan adds ``mlp`` to every block; Mixtral's blocks have none
        setattr(block, name, moe)
    return model


def attention_fn_of(model: nn.Module):
    """The weight-free attention of the model's blocks: windowed for Mixtral, plain causal otherwise."""
    window = getattr(model.config, "sliding_window", None)
    return causal_attention if window is None else partial(causal_attention, window=window)
