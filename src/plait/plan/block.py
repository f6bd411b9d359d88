"""The decoder block the planner's per-layer counts describe: the family's own, from its config.

:mod:`plait.plan.memory` and :mod:`plait.plan.timing` price a dense block from its
:class:`~plait.models.decoder.shapes.BlockShape` (``config.block_shape()``: separate or fused
q/k/v, a gated or a plain MLP, RMS or layer norms, their biases) at the local widths the family's
plan builds (``ModelFamily.local_shapes``), plus what the family adds to those parts (Qwen3's q/k
norms, found from its exact ``layer_parameters``). The Mixture-of-Experts families are built on
Llama's block; their sparse layers are priced in :mod:`plait.plan.moe` from it (:func:`llama_block`);
a latent-attention block (``BlockShape.latent``, DeepSeek-V3) is priced from its own shape.
"""

from __future__ import annotations

from plait.models.decoder.config import DecoderConfig
from plait.models.decoder.shapes import BlockShape, LocalShapes
from plait.models.llama.config import LlamaConfig
from plait.models.registry import family_of


def block_of(config: DecoderConfig) -> BlockShape:
    """The parts of ``config``'s dense block (its family's ``block_shape()``)."""
    return config.block_shape()


def llama_block(config: DecoderConfig) -> LlamaConfig:
    """``config`` as the Llama-family config whose block an MoE family's counts price; another block is
    refused by name rather than priced as a Llama's."""
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"plait.plan prices the sparse layers of Llama's decoder block; model family "
                         f"{type(config).family!r} ({type(config).__name__}) has another")
    return config


def block_parameter_count(block: BlockShape, sh: LocalShapes) -> int:
    """Local parameters of one dense block's parts at the widths ``sh``: the attention
    (:func:`attention_parameter_count`), the MLP (``mlp_matrices`` weights; the column biases
    sharded, the last one replicated), the norms (:func:`norm_parameter_count`)."""
    h, i = sh.hidden, sh.intermediate
    m = block.mlp_matrices
    mlp = m * h * i + (((m - 1) * i + h) if block.mlp_bias else 0)
    return attention_parameter_count(block, sh) + mlp + norm_parameter_count(block, sh)


def attention_parameter_count(block: BlockShape, sh: LocalShapes) -> int:
    """Local matmul parameters of one block's attention: the q/k/v projections (one fused projection
    holds the same rows) and their biases (sharded like them), the output projection and its
    replicated bias. Latent attention (``block.latent``): the query and key/value compressions
    (and their biases) whole on every rank, the per-head expansions and the output projection of
    the rank's ``q_heads``."""
    h, lat = sh.hidden, block.latent
    if lat is None:
        q, kv = sh.q, sh.kv
        return h * q + 2 * h * kv + q * h + ((q + 2 * kv) if block.qkv_bias else 0) + (h if block.o_bias else 0)
    heads, qk = sh.q_heads, lat.nope_dim + lat.rope_dim
    query = h * heads * qk if lat.q_rank is None else h * lat.q_rank + lat.q_rank * heads * qk
    kv = h * (lat.kv_rank + lat.rope_dim) + lat.kv_rank * heads * (lat.nope_dim + lat.v_dim)
    return query + kv + heads * lat.v_dim * h + _attention_bias_count(block, sh)


def _attention_bias_count(block: BlockShape, sh: LocalShapes) -> int:
    lat = block.latent
    if lat is None:
        qkv = sh.q + 2 * sh.kv
    else:
        qkv = (lat.q_rank or 0) + lat.kv_rank + lat.rope_dim
    return (qkv if block.qkv_bias else 0) + (sh.hidden if block.o_bias else 0)


def bias_parameter_count(block: BlockShape, sh: LocalShapes) -> int:
    """The biases among :func:`block_parameter_count` (no autocast copy of them is kept for backward)."""
    m = block.mlp_matrices
    return _attention_bias_count(block, sh) + (((m - 1) * sh.intermediate + sh.hidden) if block.mlp_bias else 0)


def norm_parameter_count(block: BlockShape, sh: LocalShapes) -> int:
    """The norms of one block (``block.norms``: two, Gemma 3's four; replicated on every TP rank), and
    latent attention's norms of its compressed query and key/value."""
    latent = (block.latent.q_rank or 0) + block.latent.kv_rank if block.latent is not None else 0
    return block.norms * block.norm_parameters * sh.hidden + latent


def qkv_weight_sizes(block: BlockShape, sh: LocalShapes) -> list[int]:
    """Elements of the local q/k/v weights: one fused ``(q + 2 kv) x h`` or three; latent attention's
    compressions and expansions."""
    h, lat = sh.hidden, block.latent
    if lat is not None:
        qk = lat.nope_dim + lat.rope_dim
        query = [h * sh.q_heads * qk] if lat.q_rank is None else [h * lat.q_rank, lat.q_rank * sh.q_heads * qk]
        return query + [h * (lat.kv_rank + lat.rope_dim), lat.kv_rank * sh.q_heads * (lat.nope_dim + lat.v_dim)]
    if block.fused_qkv:
        return [h * (sh.q + 2 * sh.kv)]
    return [h * sh.q, h * sh.kv]


def extra_parameters(config: DecoderConfig) -> int:
    """Parameters a family's dense block has beyond its :class:`BlockShape`'s parts (Qwen3's per-head
    q/k norm weights): small tensors replicated on every TP rank, read by no matmul."""
    full = family_of(config).local_shapes(config, 1, 1)
    return config.layer_parameters() - block_parameter_count(block_of(config), full)


__all__ = ["attention_parameter_count", "bias_parameter_count", "block_of", "block_parameter_count",
           "extra_parameters", "llama_block", "norm_parameter_count", "qkv_weight_sizes"]
