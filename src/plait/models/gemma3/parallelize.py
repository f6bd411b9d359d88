"""The tensor-parallel plan of Gemma 3: Llama's placement of heads, MLP and vocabulary with Gemma's
parts.

Per block: attention -> :class:`ParallelSelfAttention` with offset q/k head norms (replicated,
gradients summed over the TP group), the query scale and the layer's own window in its attention
function (the window acts per head on the whole sequence, so it shards with the heads); MLP ->
:class:`ParallelGatedMLP` with the GeGLU product; the four norms and the final one -> sequence-parallel
offset norms when sequence parallelism is on. The embedding is vocab-parallel (the model scales its
output, which needs no communication), the head column-parallel over the padded vocabulary and the
loss vocab-parallel; the head is re-tied to the embedding. The widths are Llama's plan's
(:func:`~plait.models.llama.parallelize.local_shapes`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from plait.mesh import ParallelMesh
from plait.models.gemma3.model import Gemma3ForCausalLM
from plait.models.llama.parallelize import _load_from_full, head_layout_for, local_shapes
from plait.nn.attention import causal_attention, query_scale_for
from plait.tensor_parallel import (
    ColumnParallelLinear,
    ParallelGatedMLP,
    ParallelSelfAttention,
    TensorParallelRNG,
    TrackedDropout,
    VocabParallelCausalLMOutput,
    VocabParallelEmbedding,
)
from plait.tensor_parallel.linear import even_rows
from plait.tensor_parallel.norm import SequenceParallelOffsetRMSNorm
from plait.tensor_parallel.plan_inputs import check_mlp_split, full_weights, rng_for

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def parallelize(model: Gemma3ForCausalLM, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                rng: TensorParallelRNG | None = None) -> Gemma3ForCausalLM:
    """Swap in tensor-parallel modules for ``mesh``'s TP group, in place; returns the model (on the
    meta device, or with real weights cut into this rank's shards)."""
    c = model.config
    tp, kv = mesh.info("tp"), mesh.info("kv")
    layout = head_layout_for(model, mesh)
    if layout.kv_replication != mesh.kv_replication:
        raise ValueError(
            f"tp={mesh.tp} with num_attention_heads={c.num_attention_heads} and num_key_value_heads="
            f"{c.num_key_value_heads} places K/V heads with kv_replication={layout.kv_replication}, but the mesh was "
            f"built with kv_replication={mesh.kv_replication}; build the mesh with kv_replication="
            f"{layout.kv_replication} (see plait.models.llama.parallelize.kv_replication_for)")
    check_mlp_split(c.intermediate_size, mesh.tp)
    sp = sequence_parallel and tp.size > 1
    rng = rng_for(rng, mesh)
    source = full_weights(model)
    device = next(model.parameters()).device
    kw: dict[str, Any] = {"device": "meta", "dtype": next(model.parameters()).dtype}
    h, eps = c.hidden_size, c.rms_norm_eps

    inner = model.model
    inner.embed_tokens = VocabParallelEmbedding(c.vocab_size, h, tp, sequence_parallel=sp, **kw)
    scale = query_scale_for(c.head_dim, c.softmax_scale)
    for i, block in enumerate(inner.layers):
        block.self_attn = ParallelSelfAttention(
            h, layout, tp, kv, partial(causal_attention, window=c.window_of(i)), qkv_bias=c.attention_bias,
            o_bias=c.o_proj_bias, sequence_parallel=sp, attention_dropout=c.attention_dropout, rng=rng,
            qk_norm_eps=eps, qk_norm_offset=True, query_scale=scale, **kw)
        block.mlp = ParallelGatedMLP(h, c.intermediate_size, tp, sequence_parallel=sp, act=c.hidden_activation, **kw)
        if sp:
            for name in _NORMS:
                setattr(block, name, SequenceParallelOffsetRMSNorm(h, eps, tp, **kw))
            block.residual_dropout = TrackedDropout(c.hidden_dropout, rng)
    if sp:
        inner.norm = SequenceParallelOffsetRMSNorm(h, eps, tp, **kw)
    model.lm_head = ColumnParallelLinear(h, c.vocab_size, tp, sequence_parallel=sp,
                                         rows=even_rows(c.vocab_size, tp, pad_to_multiple=True), **kw)
    model.output = VocabParallelCausalLMOutput(c.vocab_size, tp)
    model.tie_weights()
    model.head_layout = layout
    model.tensor_parallel = tp
    model.sequence_parallel = sp
    model.rng_tracker = rng
    if device.type != "meta":
        _load_from_full(model, source, device)
    return model


__all__ = ["local_shapes", "parallelize"]
