"""What a Mixture-of-Experts layer costs the planner: parameters, saved activations, all-to-all.

The memory and time models (:mod:`plait.plan.memory`, :mod:`plait.plan.timing`) price a dense
decoder layer by formula; an MoE family's sparse layers differ in every term, so this module
gives those terms as plain functions of the layer's shape (:class:`MoEShape`, read from the config)
and the layout, following how plait runs the layer (:mod:`plait.nn.moe`, :mod:`plait.moe`):

* **parameters** (per rank): the router ``E * h`` and, when present, the shared expert are whole on
  every rank (replicated over TP like a norm weight, averaged over ``dp`` like any dense weight);
  the routed experts are split over the expert group, ``E / ep`` whole experts of ``3 * h * w`` each
  (no TP split: the TP ranks repeat the expert work, or under sequence parallelism each
  computes its shard's), reduced and ZeRO-1-sharded over the
  expert-data-parallel group of ``dp / ep`` ranks. A family's dense layers (Qwen3-MoE's
  ``mlp_only_layers``) keep Llama's tensor-parallel MLP.
* **saved activations** of one sparse layer per micro-batch, ``T = B * S`` tokens (``B * S / tp``
  under sequence parallelism), ``N = T * k``
  assignments, ``R`` rows on the expert side (``N`` at ``ep = 1``; ``ep * N`` with expert
  parallelism, because every rank reserves a fixed slot of ``N`` rows per peer), ``c`` compute and
  ``r`` residual bytes (see :func:`moe_activation_bytes`);
* **weight copies**: the grouped matmul stacks the local experts' weights once per forward
  (``3 * E/ep * h * w`` in the compute dtype) and keeps the stacks for backward; the router's
  weight is upcast to fp32 when it is stored in bf16;
* **all-to-all** (ep > 1): each exchange moves ``ep * N`` rows of ``h`` per rank, of which the
  ``(ep - 1) * N`` rows of the other peers' slots cross the network. Per layer and micro-batch the
  forward sends the tokens (rows in the layer input's dtype ``r``) and returns the outputs (``c``),
  the backward repeats both with the gradients, and full checkpointing repeats the forward pair;
  each forward also exchanges the ``[ep, E/ep]`` int64 counts (:func:`all_to_all_bytes`).

Sequence parallelism (``parallel.sequence_parallel`` with ``tp > 1``, :mod:`plait.moe.sequence_parallel`):
each TP rank's sparse layer routes and computes only its sequence shard, so every token count
above is the rank's ``T / tp`` (the callers pass it; without sequence parallelism every TP rank
holds and computes all ``T``). The price is in the backward: each MoE parameter's gradient (router,
shared expert, local experts) is summed over the TP group once per micro-batch, and each training
forward sums ``E + 1`` int64 counts over it (:func:`sequence_parallel_tp_bytes`).

Routing is assumed balanced (each expert gets ``N / E`` assignments of a micro-batch): the
executed FLOPs of the experts are those of the ``k`` chosen experts per token, as in
:mod:`plait.models.flops`. An imbalanced router makes the slowest rank slower; that is not priced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.models.decoder.config import DecoderConfig
from plait.models.registry import family_of
from plait.plan.block import attention_parameter_count, llama_block, norm_parameter_count


@dataclass(frozen=True)
class MoEShape:
    """The sizes of a family's sparse layers (Hugging Face names in the comments)."""

    experts: int           # num_local_experts (Mixtral) / num_experts (Qwen3-MoE)
    top_k: int             # num_experts_per_tok
    width: int             # one expert's intermediate size (Mixtral intermediate_size, moe_intermediate_size)
    sparse: frozenset[int]  # the decoder layers whose MLP is an MoE layer
    renormalize: bool = True    # top-k weights renormalised (one more saved [T, k] division)
    shared_width: int = 0       # shared_expert_intermediate_size (0: no shared expert)
    shared_gate: bool = False   # a sigmoid gate on the shared expert (Qwen2-MoE style)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse


def moe_shape(config: Any) -> MoEShape | None:
    """The config's :class:`MoEShape`, or ``None`` for a dense family (no ``moe_layer_ids``)."""
    ids = getattr(config, "moe_layer_ids", None)
    if not callable(ids):
        return None
    sparse = frozenset(ids())
    if not sparse:
        return None
    is_moe = getattr(config, "is_moe_layer", None)
    if callable(is_moe):  # blocks after the decoder (DeepSeek-V3's prediction modules) may be sparse too
        sparse |= {layer for layer in config.tail_layer_ids() if is_moe(layer)}
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    return MoEShape(experts=int(experts), top_k=int(config.num_experts_per_tok), width=int(width), sparse=sparse,
                    renormalize=bool(getattr(config, "norm_topk_prob", True)), shared_width=shared,
                    shared_gate=bool(getattr(config, "shared_expert_gate", shared > 0)))


def local_experts(shape: MoEShape, ep: int) -> int:
    """Experts of each sparse layer on one rank of an expert group of ``ep``."""
    if shape.experts % ep:
        raise ValueError(f"ep={ep} does not divide the {shape.experts} experts of a layer")
    return shape.experts // ep


def expert_parameter_count(shape: MoEShape, hidden: int, ep: int) -> int:
    """Routed-expert parameters of one sparse layer on one rank: ``E/ep * 3 * h * w``."""
    return local_experts(shape, ep) * 3 * hidden * shape.width


def shared_parameter_count(shape: MoEShape, hidden: int) -> int:
    """The router and the shared expert (with its gate): whole on every rank."""
    shared = 3 * hidden * shape.shared_width + (hidden if shape.shared_gate else 0)
    return shape.experts * hidden + shared


def full_ffn_parameters(config: DecoderConfig, shape: MoEShape, layer: int) -> int:
    """The unsharded feed-forward parameters of decoder layer ``layer`` (sparse or dense)."""
    h = config.hidden_size
    if shape.is_sparse(layer):
        return shared_parameter_count(shape, h) + expert_parameter_count(shape, h, 1)
    i = config.intermediate_size
    return 3 * h * i + ((2 * i + h) if llama_block(config).mlp_bias else 0)


def attention_extra_parameters(config: DecoderConfig) -> int:
    """Per-layer parameters a family adds to its block's attention and norms (Qwen3's q/k norm
    weights), from the exact model count: the decoder layers' total less their feed-forward
    parameters and the block's attention and norms (:mod:`plait.plan.block`)."""
    h, L = config.hidden_size, config.num_hidden_layers
    shape = moe_shape(config)
    assert shape is not None
    embed = config.vocab_size * h
    tail = config.tail_layer_ids()
    rest = embed + (0 if config.tie_word_embeddings else embed) + config.final_norm_parameters()
    rest += config.tail_extra_parameters()
    blocks = config.num_parameters() - rest
    layers = list(range(L)) + tail
    ffn = sum(full_ffn_parameters(config, shape, layer) for layer in layers)
    block, full = config.block_shape(), family_of(config).local_shapes(config, 1, 1)
    attention_norms = attention_parameter_count(block, full) + norm_parameter_count(block, full)
    return (blocks - ffn) // len(layers) - attention_norms


def layer_kinds(shape: MoEShape, layers: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """``(a representative layer, how many)`` for the sparse and the dense layers among ``layers``
    (the per-layer terms depend only on the kind, so a chunk is priced with two calls, not one per
    layer)."""
    sparse = [layer for layer in layers if shape.is_sparse(layer)]
    dense = [layer for layer in layers if not shape.is_sparse(layer)]
    return [(group[0], len(group)) for group in (sparse, dense) if group]


def expert_rows(shape: MoEShape, tokens: int, ep: int) -> int:
    """Rows the expert side of a sparse layer holds for ``tokens`` tokens: ``N = tokens * k`` at
    ``ep = 1``; ``ep * N`` with expert parallelism (one fixed slot of ``N`` rows per peer)."""
    n = tokens * shape.top_k
    return n if ep == 1 else ep * n


def moe_activation_bytes(shape: MoEShape, hidden: int, tokens: int, ep: int, *, compute: int, residual: int,
                         autocast: bool = False, losses: bool = True) -> int:
    """Bytes one sparse layer's MoE block saves for backward per micro-batch (``tokens = B * S``).

    Router (fp32, autocast off): its fp32 input ``T h 4`` (the layer input itself when ``r = 4``,
    else an upcast copy), the softmax ``T E 4``, the top-k indices ``T k 8`` and, when the top-k
    weights are renormalised, the weights and their sum ``T (k + 1) 4``; with the load-balancing
    and z-losses on (training), the logits ``T E 4`` and the log-sum-exp ``T 4``.
    Dispatch: the sorted token and assignment indices ``2 N 8``; with ``ep > 1`` the send positions
    ``N 8``, the rows copied into the send buffer ``N h r`` (``index_copy`` keeps its source), the
    receive order ``R 8``, the valid-row mask ``R`` and the outputs copied into the return buffer
    ``R h c``. Experts (grouped matmul): their input rows ``R h c`` and the SwiGLU tensors gate, up,
    ``silu(gate)`` and the product, ``4 R w c``. Combine: the expert outputs upcast to fp32 and
    their weights, ``N (h + 1) 4``, and the weighted rows in the input's dtype, ``N h r``, copied
    back to token order.
    A shared expert adds a gated MLP over the ``T`` tokens: its SwiGLU tensors ``4 T w_s c`` and its
    input as its linears save it (under autocast each casts its own copy, ``T h c`` per linear, two
    or three with the gate; otherwise the layer input itself, already counted as the router's when
    ``r = 4``, else ``T h r``); the sigmoid gate adds its output and the gated product's other
    factor, ``T (1 + h) c``.
    """
    T, k, E, h = tokens, shape.top_k, shape.experts, hidden
    c, r = compute, residual
    N = T * k
    R = expert_rows(shape, T, ep)
    router = T * h * 4 + T * E * 4 + T * k * 8 + (T * (k + 1) * 4 if shape.renormalize else 0)
    if losses:
        router += T * E * 4 + T * 4
    dispatch = 2 * N * 8 + ((N * 8 + N * h * r + R * 8 + R + R * h * c) if ep > 1 else 0)
    experts = R * h * c + 4 * R * shape.width * c
    combine = N * (h + 1) * 4 + N * h * r
    shared = 0
    if shape.shared_width:
        linears = 3 if shape.shared_gate else 2
        inputs = linears * T * h * c if autocast else (T * h * r if r != 4 else 0)
        shared = inputs + 4 * T * shape.shared_width * c + (T * (1 + h) * c if shape.shared_gate else 0)
    return router + dispatch + experts + combine + shared


def moe_weight_copies(shape: MoEShape, hidden: int, ep: int, *, compute: int, param: int, autocast: bool) -> int:
    """Weight copies one sparse layer keeps per in-flight micro-batch: the stacked local expert
    weights of the grouped matmul (``3 * E/ep * h * w * c``, every preset: the stack is a new
    tensor), the router weight upcast to fp32 when stored in fewer bytes (``E h 4``), and under
    autocast the shared expert's bf16 weight copies."""
    h = hidden
    stacks = expert_parameter_count(shape, h, ep) * compute
    router = shape.experts * h * 4 if param != 4 else 0
    shared = 2 * (3 * h * shape.shared_width + (h if shape.shared_gate else 0)) if autocast else 0
    return stacks + router + shared


def moe_comm_buffer_bytes(shape: MoEShape, hidden: int, tokens: int, ep: int, residual: int) -> int:
    """The fixed-slot exchange's send and receive buffers of one layer at a time (ep > 1):
    ``2 * ep * N * h * r`` (freed after the layer, so one layer's pair is counted at the peak)."""
    if ep == 1:
        return 0
    return 2 * expert_rows(shape, tokens, ep) * hidden * residual


def all_to_all_bytes(shape: MoEShape, hidden: int, tokens: int, ep: int, *, compute: int, residual: int,
                     recompute: bool = False) -> float:
    """Bytes one rank sends over the expert group per sparse layer and micro-batch (0 at ep = 1).

    Each exchange is an equal-split all-to-all of ``ep * N`` rows, ``N = tokens * k``; the rank's
    own slot stays local, so ``(ep - 1) * N`` rows cross the links. Forward: the tokens (``r``
    bytes an element, the layer input's dtype) and the expert outputs (``c``); backward: the same
    two exchanges of their gradients; a recomputed forward (full checkpointing) repeats the forward
    pair. Each forward also exchanges the per-expert counts, ``(ep - 1)/ep * E * 8`` bytes.
    """
    if ep == 1:
        return 0.0
    n = tokens * shape.top_k
    rows = (ep - 1) * n * hidden
    forwards = 2 if recompute else 1
    pair = rows * (residual + compute)
    counts = (ep - 1) / ep * shape.experts * 8
    return forwards * (pair + counts) + pair


def moe_parameter_count(shape: MoEShape, hidden: int, ep: int) -> int:
    """Every parameter of one sparse layer on a rank: the router, the shared expert and the
    ``E / ep`` local experts (what sequence parallelism sums over TP)."""
    return shared_parameter_count(shape, hidden) + expert_parameter_count(shape, hidden, ep)


def sequence_parallel_tp_bytes(shape: MoEShape, hidden: int, ep: int, tp: int, *, grad: int) -> float:
    """Bytes one rank moves over its TP group per sparse layer and micro-batch under sequence
    parallelism (0 at ``tp = 1``): the ring all-reduce of each MoE parameter's gradient, autograd's
    in the parameter dtype (``grad`` bytes), ``2 (tp-1)/tp * P_moe * grad``
    (:func:`moe_parameter_count`; once per micro-batch: the hooks run in its backward, a recomputed
    forward adds none), and of the forward's ``E + 1`` int64 routing counts, ``2 (tp-1)/tp (E+1) 8``
    (counted once: a recomputed forward replays them; sent when the aux loss is on, assumed in training)."""
    if tp == 1:
        return 0.0
    ring = 2 * (tp - 1) / tp
    return ring * (moe_parameter_count(shape, hidden, ep) * grad + (shape.experts + 1) * 8)


def active_ffn_matmul_parameters(config: DecoderConfig, shape: MoEShape, layer: int, tp: int) -> int:
    """Feed-forward parameters one token's matmuls read on a rank of a TP group of ``tp``: a sparse
    layer's router, ``k`` experts and shared expert (whole on every TP rank); a dense layer's MLP
    split ``tp`` ways (its executed FLOPs are ``6`` times this per token)."""
    h = config.hidden_size
    if shape.is_sparse(layer):
        return shared_parameter_count(shape, h) + shape.top_k * 3 * h * shape.width
    i = config.intermediate_size // tp
    return 3 * h * i


__all__ = ["MoEShape", "active_ffn_matmul_parameters", "all_to_all_bytes", "attention_extra_parameters",
           "expert_parameter_count", "expert_rows", "full_ffn_parameters", "layer_kinds", "local_experts",
           "moe_activation_bytes", "moe_comm_buffer_bytes", "moe_parameter_count", "moe_shape", "moe_weight_copies",
           "sequence_parallel_tp_bytes", "shared_parameter_count"]
