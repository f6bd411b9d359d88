"""The tensor-parallel plan of DeepSeek-V3.

Per block: attention -> :class:`~plait.tensor_parallel.latent_attention.ParallelLatentAttention`
(the heads' expansions sharded, the compressions replicated: see that module for why); a dense
MLP -> :class:`ParallelGatedMLP`; an MoE layer stays whole on every TP rank, as in the other MoE
families (:mod:`plait.models.mixtral.parallelize`: no TP communication in the layer; under
sequence parallelism each rank routes its own shard); the norms -> sequence-parallel norms when
sequence parallelism is on. The embedding is vocab-parallel, the head column-parallel over the
padded vocabulary and the loss vocab-parallel.

The multi-token-prediction modules get the same plan for their block, sequence-parallel input and
output norms, and a replicated ``eh_proj`` (``2h -> h``, its gradient summed over TP under sequence
parallelism); they reuse the model's embedding, head and loss module.

Works on the meta device or on real weights (cut from the full tensors, the router's balancing
biases restored). :func:`local_shapes` gives the planner the widths: Llama's fields with the
latent attention's per-rank query heads (``q`` is their ``qk_head_dim`` width, ``kv`` the rank's
expanded key and value width).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.mesh import ParallelMesh
from plait.models.decoder.shapes import LocalShapes
from plait.models.deepseek_v3.config import LATENT_NORM_EPS, DeepseekV3Config
from plait.models.deepseek_v3.model import DeepseekV3ForCausalLM, MultiTokenPrediction
from plait.nn.attention import causal_attention, query_scale_for
from plait.nn.buffers import reset_buffers
from plait.nn.moe import MoELayer
from plait.parallel_state import shard_specs
from plait.tensor_parallel import (
    ColumnParallelLinear,
    HeadLayout,
    ParallelGatedMLP,
    SequenceParallelRMSNorm,
    TensorParallelRNG,
    TrackedDropout,
    VocabParallelCausalLMOutput,
    VocabParallelEmbedding,
)
from plait.tensor_parallel.latent_attention import ParallelLatentAttention
from plait.tensor_parallel.linear import ReplicatedLinear, even_rows
from plait.tensor_parallel.plan_inputs import check_mlp_split, full_weights, rng_for


def check_heads(config: DeepseekV3Config, tp: int) -> None:
    if config.num_attention_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={config.num_attention_heads}: multi-head "
                         f"latent attention shards whole heads; choose a tp dividing it")


def local_shapes(config: DeepseekV3Config, tp: int, kv_replication: int = 1) -> LocalShapes:
    """The local widths :func:`parallelize` builds at degree ``tp`` (``kv_replication`` has no meaning
    for MLA and is ignored)."""
    c = config
    if tp > 1:
        check_heads(c, tp)
        check_mlp_split(c.intermediate_size, tp)
    heads = c.num_attention_heads // tp
    vocab = -(-c.vocab_size // tp) if tp > 1 else c.vocab_size
    return LocalShapes(tp, c.hidden_size, heads * c.qk_head_dim, heads * (c.qk_nope_head_dim + c.v_head_dim),
                       heads, c.intermediate_size // tp, vocab, False, vocab * tp != c.vocab_size)


def parallelize(model: DeepseekV3ForCausalLM, mesh: ParallelMesh, *, sequence_parallel: bool = False,
                rng: TensorParallelRNG | None = None) -> DeepseekV3ForCausalLM:
    """Swap in tensor-parallel modules for ``mesh``'s TP group, in place; returns the model."""
    c = model.config
    tp = mesh.info("tp")
    check_heads(c, mesh.tp)
    check_mlp_split(c.intermediate_size, mesh.tp)
    sp = sequence_parallel and tp.size > 1
    rng = rng_for(rng, mesh)
    source = full_weights(model)
    device = next(model.parameters()).device
    kw: dict[str, Any] = {"device": "meta", "dtype": next(model.parameters()).dtype}
    h, eps = c.hidden_size, c.rms_norm_eps

    def parallel_block(block: nn.Module) -> None:
        block.self_attn = ParallelLatentAttention(
            h, c.num_attention_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
            nope_dim=c.qk_nope_head_dim, rope_dim=c.qk_rope_head_dim, v_dim=c.v_head_dim, bias=c.attention_bias,
            interleave=c.rope_interleave, query_scale=query_scale_for(c.qk_head_dim, c.softmax_scale),
            latent_eps=LATENT_NORM_EPS, tp=tp, attention_fn=causal_attention, sequence_parallel=sp,
            attention_dropout=c.attention_dropout, rng=rng, **kw)
        if not isinstance(block.mlp, MoELayer):  # an MoE layer stays whole (see the module doc)
            block.mlp = ParallelGatedMLP(h, c.intermediate_size, tp, sequence_parallel=sp, **kw)
        if sp:
            block.input_layernorm = SequenceParallelRMSNorm(h, eps, tp, **kw)
            block.post_attention_layernorm = SequenceParallelRMSNorm(h, eps, tp, **kw)
            block.residual_dropout = TrackedDropout(c.hidden_dropout, rng)

    inner = model.model
    inner.embed_tokens = VocabParallelEmbedding(c.vocab_size, h, tp, sequence_parallel=sp, **kw)
    for block in inner.layers:
        parallel_block(block)
    for module in model.mtp:
        assert isinstance(module, MultiTokenPrediction)
        parallel_block(module)
        module.eh_proj = ReplicatedLinear(2 * h, h, tp, sequence_parallel=sp, **kw)
        if sp:
            module.enorm = SequenceParallelRMSNorm(h, eps, tp, **kw)
            module.hnorm = SequenceParallelRMSNorm(h, eps, tp, **kw)
            module.shared_head.norm = SequenceParallelRMSNorm(h, eps, tp, **kw)
    if sp:
        inner.norm = SequenceParallelRMSNorm(h, eps, tp, **kw)
    model.lm_head = ColumnParallelLinear(h, c.vocab_size, tp, sequence_parallel=sp,
                                         rows=even_rows(c.vocab_size, tp, pad_to_multiple=True), **kw)
    model.output = VocabParallelCausalLMOutput(c.vocab_size, tp)
    model.tie_weights()
    model.head_layout = HeadLayout.plan(c.num_attention_heads, c.num_attention_heads, c.qk_rope_head_dim, mesh.tp)
    model.tensor_parallel = tp
    model.sequence_parallel = sp
    model.rng_tracker = rng
    if device.type != "meta":
        _load_from_full(model, source, device)
    return model


@torch.no_grad()
def _load_from_full(model: DeepseekV3ForCausalLM, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Allocate on ``device`` and cut each parameter from the full tensors; persistent buffers (the
    routers' balancing biases) are copied back whole."""
    model.to_empty(device=device)
    model.tie_weights()
    reset_buffers(model)
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        src = full[name].to(device)
        p.copy_(specs[name].shard(src) if name in specs else src)
    for name, b in model.named_buffers():
        if name in full:
            b.copy_(full[name].to(device))


__all__ = ["check_heads", "local_shapes", "parallelize"]
