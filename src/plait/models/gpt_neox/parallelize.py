"""The tensor-parallel plan of GPT-NeoX.

Order of application (fixed, as in Llama's plan):

1. TP/SP swap: ``embed_in`` -> vocab-parallel; per block, attention ->
   :class:`~plait.tensor_parallel.fused_attention.ParallelFusedSelfAttention` (the fused
   ``query_key_value`` split by whole heads, so each rank gets its heads' q, k and v; ``dense``
   row-parallel), MLP -> :class:`~plait.tensor_parallel.mlp.ParallelDenseMLP`, layer norms ->
   :class:`~plait.tensor_parallel.norm.SequenceParallelLayerNorm` when SP is on (weight and bias
   gradients summed over the TP group); the final layer norm likewise; ``embed_out`` ->
   column-parallel over the (padded) vocabulary, and the loss -> vocab-parallel cross-entropy.
2. Dropout: attention dropout on the local heads and, under sequence parallelism, the residual and
   embedding dropout on the sequence shards draw from the per-TP-rank stream ``model.rng_tracker``;
   dropout on the replicated residual (no SP) keeps the global generator.

The parallel residual needs nothing of its own: attention and MLP each end in a row-parallel
reduction (a reduce-scatter under SP), so both outputs are whole (or the rank's sequence shard)
when they are added to the residual.

There is no grouped-query attention, so no KV replication (the mesh's factor must be 1); head
padding (``tp`` not dividing the heads) works as in Llama's plan. Works on the meta device or on
real weights, whose full tensors are then cut into this rank's shards.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.mesh import ParallelMesh
from plait.models.decoder.shapes import LocalShapes
from plait.models.gpt_neox.config import GPTNeoXConfig
from plait.models.gpt_neox.model import GPTNeoXForCausalLM
from plait.nn.attention import causal_attention
from plait.nn.buffers import reset_buffers
from plait.parallel_state import shard_specs
from plait.tensor_parallel import (
    ColumnParallelLinear,
    HeadLayout,
    ParallelDenseMLP,
    ParallelFusedSelfAttention,
    SequenceParallelLayerNorm,
    TensorParallelRNG,
    TrackedDropout,
    VocabParallelCausalLMOutput,
    VocabParallelEmbedding,
)
from plait.tensor_parallel.linear import even_rows
from plait.tensor_parallel.plan_inputs import check_mlp_split, full_weights, rng_for


def head_layout(config: GPTNeoXConfig, tp: int, kv_replication: int = 1) -> HeadLayout:
    """The heads' placement at degree ``tp``: one K/V head per query head, never replicated."""
    c = config
    layout = HeadLayout.plan(c.num_attention_heads, c.num_key_value_heads, c.head_dim, tp,
                             kv_replication if kv_replication > 1 else None)
    if layout.kv_replication != 1:
        raise ValueError(f"gpt_neox has one K/V head per query head and takes no KV replication; got "
                         f"kv_replication={layout.kv_replication}: build the mesh with kv_replication=1")
    return layout


def local_shapes(config: GPTNeoXConfig, tp: int, kv_replication: int = 1) -> LocalShapes:
    """The local widths :func:`parallelize` builds at degree ``tp`` (the planner's :class:`LocalShapes`).

    ``tp = 1`` keeps the unparallelized model. Otherwise each rank holds whole heads (padded as
    :meth:`HeadLayout.plan` places them), their q, k and v all local (``kv == q``), the MLP split
    ``tp`` ways and ``ceil(V / tp)`` vocabulary rows.
    """
    c = config
    q = c.num_attention_heads * c.head_dim
    if tp == 1:
        return LocalShapes(1, c.hidden_size, q, q, c.num_attention_heads, c.intermediate_size, c.vocab_size,
                           False, False)
    if c.intermediate_size % tp:
        raise ValueError(f"intermediate_size={c.intermediate_size} is not divisible by tp={tp}")
    heads = head_layout(c, tp, kv_replication)
    vocab = -(-c.vocab_size // tp)
    local_q = heads.local_q_heads * c.head_dim
    return LocalShapes(tp, c.hidden_size, local_q, local_q, heads.local_q_heads, c.intermediate_size // tp, vocab,
                       heads.needs_padding, vocab * tp != c.vocab_size)


def parallelize(model: GPTNeoXForCausalLM, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                rng: TensorParallelRNG | None = None) -> GPTNeoXForCausalLM:
    """Swap in tensor-parallel modules for ``mesh``'s TP group, in place; returns the model.

    ``rng`` is the per-TP-rank random stream for dropout on sharded activations (default: seed 0
    and this rank's TP rank); it is stored as ``model.rng_tracker``, the head layout as
    ``model.head_layout``.
    """
    c = model.config
    tp = mesh.info("tp")
    if mesh.kv_replication != 1:
        raise ValueError(f"gpt_neox takes no KV replication (one K/V head per query head); the mesh was built with "
                         f"kv_replication={mesh.kv_replication}: build it with kv_replication=1")
    layout = head_layout(c, mesh.tp)
    check_mlp_split(c.intermediate_size, mesh.tp)
    sp = sequence_parallel and tp.size > 1
    rng = rng_for(rng, mesh)
    source = full_weights(model)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    kw: dict[str, Any] = {"device": "meta", "dtype": dtype}
    h, eps = c.hidden_size, c.layer_norm_eps

    inner = model.gpt_neox
    inner.embed_in = VocabParallelEmbedding(c.vocab_size, h, tp, sequence_parallel=sp, **kw)
    for block in inner.layers:
        block.attention = ParallelFusedSelfAttention(h, layout, tp, causal_attention, bias=c.attention_bias,
                                                     sequence_parallel=sp, attention_dropout=c.attention_dropout,
                                                     rng=rng, **kw)
        block.mlp = ParallelDenseMLP(h, c.intermediate_size, tp, c.hidden_act, bias=True, sequence_parallel=sp, **kw)
        if sp:
            block.input_layernorm = SequenceParallelLayerNorm(h, eps, tp, **kw)
            block.post_attention_layernorm = SequenceParallelLayerNorm(h, eps, tp, **kw)
            # the residual stream is a sequence shard here, so each rank needs its own mask
            block.residual_dropout = TrackedDropout(c.hidden_dropout, rng)
    if sp:
        inner.final_layer_norm = SequenceParallelLayerNorm(h, eps, tp, **kw)
        inner.emb_dropout = TrackedDropout(c.hidden_dropout, rng)
    model.embed_out = ColumnParallelLinear(h, c.vocab_size, tp, sequence_parallel=sp,
                                           rows=even_rows(c.vocab_size, tp, pad_to_multiple=True), **kw)
    model.output = VocabParallelCausalLMOutput(c.vocab_size, tp)
    model.head_layout = layout
    model.tensor_parallel = tp
    model.sequence_parallel = sp
    model.rng_tracker = rng

    if device.type != "meta":
        _load_from_full(model, source, device)
    return model


@torch.no_grad()
def _load_from_full(model: GPTNeoXForCausalLM, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Allocate the new modules on ``device`` and cut each parameter from the full tensors."""
    model.to_empty(device=device)
    reset_buffers(model)
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        src = full[name].to(device)
        p.copy_(specs[name].shard(src) if name in specs else src)


__all__ = ["head_layout", "local_shapes", "parallelize"]
