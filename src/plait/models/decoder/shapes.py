"""What the planner (:mod:`plait.plan`) needs to know of a family's block without building a model.

* :class:`LocalShapes`: the per-rank widths a family's tensor-parallel plan gives one decoder
  layer and the vocabulary. A family's ``local_shapes`` (:class:`~plait.models.family.ModelFamily`)
  computes them from the config alone, as its ``parallelize`` builds them, so that the planner
  prices the shards a run will hold; ``tests/test_family_shapes.py`` checks them against the
  parameters of every family's parallelized model.
* :class:`BlockShape`: the structure of one dense decoder block (which projections, biases, MLP
  and norms it has), from the config's ``block_shape()``, so that the planner counts its
  parameters, FLOPs and saved activations for that block rather than for Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class LocalShapes:
    """Per-TP-rank widths of one decoder layer and the vocabulary (``tp = 1``: the full model's)."""

    tp: int
    hidden: int
    q: int            # local query width, padding heads included
    kv: int           # local K (= V) width, replicated KV heads included
    q_heads: int      # local query heads
    intermediate: int  # local width of a dense MLP
    vocab: int        # local vocabulary rows (padded)
    head_padding: bool
    vocab_padding: bool
    ep: int = 1       # expert parallelism: each sparse layer holds experts / ep whole experts (set by the planner)


@dataclass(frozen=True)
class LatentAttentionShape:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank bottleneck
    (``q_rank``; ``None``: one direct projection), keys and values from one compressed ``kv_rank``
    latent plus a shared ``rope_dim`` rotary key, expanded per head into ``nope_dim`` key and
    ``v_dim`` value channels. The compressions and their norms are whole on every TP rank; the
    expansions and the output projection are split by heads (the rank's ``LocalShapes.q_heads``)."""

    q_rank: int | None
    kv_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int


@dataclass(frozen=True)
class BlockShape:
    """The parts of one dense decoder block, as the planner prices them.

    ``fused_qkv``: one q/k/v projection (GPT-NeoX's ``query_key_value``, whose output every view of
    q, k and v keeps alive) rather than three (Llama's ``q_proj``, ``k_proj``, ``v_proj``).
    ``qkv_bias`` / ``o_bias``: biases on the q/k/v and the output projection.
    ``gated_mlp``: gate, up and down projections with the SwiGLU product (Llama), or up and down with
    an activation between them (GPT-NeoX's ``dense_h_to_4h`` / ``dense_4h_to_h``); ``mlp_bias``
    their biases; ``activation``: the plain MLP's (``hidden_act``; ReLU keeps only its output for
    backward, the others their input).
    ``norm``: ``"rms"`` (weight only; Llama) or ``"layer"`` (weight and bias; GPT-NeoX).
    ``parallel_residual``: both norms read the block's input (GPT-NeoX's ``use_parallel_residual``).
    ``rotary_dim``: the rotated width of each head (the rotary tables' width).
    ``norms``: the hidden-size norms of one block (two for Llama's; Gemma 3's four: before and after
    attention and the MLP).
    ``latent``: the attention is multi-head latent attention of that shape (``qkv_bias`` then biases
    the compressions) rather than q/k/v projections of ``LocalShapes.q`` and ``kv`` rows.
    """

    fused_qkv: bool
    qkv_bias: bool
    o_bias: bool
    gated_mlp: bool
    mlp_bias: bool
    norm: Literal["rms", "layer"]
    parallel_residual: bool
    rotary_dim: int
    activation: str = "silu"
    norms: int = 2
    latent: LatentAttentionShape | None = None

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: 3 gated, 2 plain."""
        return 3 if self.gated_mlp else 2

    @property
    def norm_parameters(self) -> int:
        """Parameters per channel of one norm: its weight, and a layer norm's bias."""
        return 2 if self.norm == "layer" else 1


__all__ = ["BlockShape", "LatentAttentionShape", "LocalShapes"]
