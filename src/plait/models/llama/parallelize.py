"""The tensor-parallel plan of the Llama model.

Order of application (fixed; later issues add their steps after these):

1. TP/SP swap: embedding -> vocab-parallel; per block, attention -> :class:`ParallelSelfAttention`
   (head layout with KV replication and padding), MLP -> :class:`ParallelGatedMLP`, norms ->
   sequence-parallel norms when SP is on; final norm likewise; output head -> column-parallel
   over the (padded) vocabulary, and the loss -> vocab-parallel cross-entropy.
2. Dropout: attention dropout on the local heads and, under sequence parallelism, residual
   dropout on the sequence shards draw from the per-TP-rank stream ``model.rng_tracker``
   (:class:`TensorParallelRNG`); residual dropout on the replicated residual (no SP) keeps the
   global generator, which the caller seeds identically on the ranks of a TP group.
3. Re-tie the output head to the embedding when the config ties them.

Activation checkpointing (:mod:`plait.activation_checkpointing`) is applied after this plan and
after pipeline splitting, to the modules it swapped in.

Works on a model on the meta device (nothing is allocated; see :mod:`plait.materialize`) or on
a model with real weights, whose full tensors are then cut into this rank's shards, so a
reference model can be turned into its sharded twin for parity tests.

:func:`local_shapes` gives the planner the widths this plan builds, from the config alone.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from plait.mesh import ParallelMesh
from plait.models.decoder.shapes import LocalShapes
from plait.models.llama.config import LlamaConfig
from plait.models.llama.model import LlamaForCausalLM
from plait.nn.attention import causal_attention
from plait.nn.buffers import reset_buffers
from plait.parallel_state import shard_specs
from plait.tensor_parallel import (
    ColumnParallelLinear,
    HeadLayout,
    ParallelGatedMLP,
    ParallelSelfAttention,
    SequenceParallelRMSNorm,
    TensorParallelRNG,
    TrackedDropout,
    VocabParallelCausalLMOutput,
    VocabParallelEmbedding,
)
from plait.tensor_parallel.attention import AttentionFn
from plait.tensor_parallel.linear import even_rows
from plait.tensor_parallel.plan_inputs import check_mlp_split, full_weights, rng_for

#: a Llama-family model (Llama's own or a family's subclass); the plan returns the model it was given
ModelT = TypeVar("ModelT", bound=LlamaForCausalLM)


def head_layout_for(model: LlamaForCausalLM, mesh: ParallelMesh) -> HeadLayout:
    c = model.config
    return HeadLayout.plan(c.num_attention_heads, c.num_key_value_heads, c.head_dim, mesh.tp,
                           mesh.kv_replication if mesh.kv_replication > 1 else None, mesh.kv_placement)


def kv_replication_for(config: LlamaConfig, tp: int, requested: int | None = None) -> int:
    """The KV replication factor a mesh needs for ``config`` at degree ``tp`` (validated)."""
    return HeadLayout.plan(config.num_attention_heads, config.num_key_value_heads, config.head_dim, tp,
                           requested).kv_replication


def local_shapes(config: LlamaConfig, tp: int, kv_replication: int = 1) -> LocalShapes:
    """The local widths :func:`parallelize` builds at degree ``tp`` on a mesh of ``kv_replication``
    (the planner's :class:`LocalShapes`; Qwen3, Mistral and the MoE families share this plan).

    ``tp = 1`` keeps the unparallelized model. Otherwise heads follow :meth:`HeadLayout.plan`
    (``kv_replication`` when above 1, else the automatic factor, as :func:`head_layout_for` does),
    the MLP is split ``tp`` ways and the vocabulary in ``ceil(V / tp)`` rows per rank.
    """
    c = config
    if tp == 1:
        return LocalShapes(1, c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                           c.num_attention_heads, c.intermediate_size, c.vocab_size, False, False)
    if c.intermediate_size % tp:
        raise ValueError(f"intermediate_size={c.intermediate_size} is not divisible by tp={tp}")
    heads = HeadLayout.plan(c.num_attention_heads, c.num_key_value_heads, c.head_dim, tp,
                            kv_replication if kv_replication > 1 else None)
    vocab = -(-c.vocab_size // tp)
    return LocalShapes(tp, c.hidden_size, heads.local_q_heads * c.head_dim, heads.local_kv_heads * c.head_dim,
                       heads.local_q_heads, c.intermediate_size // tp, vocab, heads.needs_padding,
                       vocab * tp != c.vocab_size)


def parallelize(model: ModelT, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                rng: TensorParallelRNG | None = None, attention_fn: AttentionFn = causal_attention,
                qk_norm: bool = False) -> ModelT:
    """Swap in tensor-parallel modules for ``mesh``'s TP group, in place; returns the model.

    Families built on Llama's block reuse this plan with their attention variant:
    ``attention_fn`` is the weight-free attention on the local heads (Mistral passes a sliding
    window), ``qk_norm`` adds per-head q/k norms with TP-summed weight gradients (Qwen3).

    The KV replication factor is ``mesh.kv_replication`` when it is above 1, otherwise chosen
    automatically (the smallest that needs no padding). The resolved head layout is stored as
    ``model.head_layout``. ``rng`` is the per-TP-rank random stream for dropout on sharded
    activations (default: seed 0 and this rank's TP rank); it is stored as ``model.rng_tracker``.
    """
    c = model.config
    tp, kv = mesh.info("tp"), mesh.info("kv")
    layout = head_layout_for(model, mesh)
    if layout.kv_replication != mesh.kv_replication:
        raise ValueError(
            f"tp={mesh.tp} with num_attention_heads={c.num_attention_heads} and num_key_value_heads="
            f"{c.num_key_value_heads} places K/V heads with kv_replication={layout.kv_replication}, but the "
            f"mesh was built with kv_replication={mesh.kv_replication}; build the mesh with "
            f"kv_replication={layout.kv_replication} (see plait.models.llama.parallelize.kv_replication_for)"
        )
    check_mlp_split(c.intermediate_size, mesh.tp)
    sp = sequence_parallel and tp.size > 1
    rng = rng_for(rng, mesh)
    source = full_weights(model)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    kw: dict[str, Any] = {"device": "meta", "dtype": dtype}

    inner = model.model
    inner.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp, sequence_parallel=sp, **kw)
    for block in inner.layers:
        block.self_attn = ParallelSelfAttention(c.hidden_size, layout, tp, kv, attention_fn,
                                                qkv_bias=c.attention_bias, o_bias=c.o_proj_bias,
                                                sequence_parallel=sp, attention_dropout=c.attention_dropout,
                                                rng=rng, qk_norm_eps=c.rms_norm_eps if qk_norm else None, **kw)
        block.mlp = ParallelGatedMLP(c.hidden_size, c.intermediate_size, tp, bias=c.mlp_bias,
                                     sequence_parallel=sp, **kw)
        if sp:
            block.input_layernorm = SequenceParallelRMSNorm(c.hidden_size, c.rms_norm_eps, tp, **kw)
            block.post_attention_layernorm = SequenceParallelRMSNorm(c.hidden_size, c.rms_norm_eps, tp, **kw)
            # the residual stream is a sequence shard here, so each rank needs its own mask
            block.residual_dropout = TrackedDropout(c.hidden_dropout, rng)
    if sp:
        inner.norm = SequenceParallelRMSNorm(c.hidden_size, c.rms_norm_eps, tp, **kw)
    model.lm_head = ColumnParallelLinear(c.hidden_size, c.vocab_size, tp, sequence_parallel=sp,
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


@torch.no_grad()
def _load_from_full(model: LlamaForCausalLM, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Allocate the new modules on ``device`` and cut each parameter from the full tensors."""
    model.to_empty(device=device)
    model.tie_weights()
    reset_buffers(model)
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        src = full[name].to(device)
        p.copy_(specs[name].shard(src) if name in specs else src)


__all__ = ["parallelize", "head_layout_for", "kv_replication_for", "local_shapes", "reset_buffers"]
