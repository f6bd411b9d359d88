"""Step-time model of a layout: compute, TP / DP / PP communication, pipeline bubble, MFU.

:func:`estimate_step_time` prices one optimizer step of ``microbatches`` micro-batches of
``micro_batch_size x seq_len`` tokens per data-parallel replica. Every number is a first-order
estimate meant to *rank* layouts, not to predict a wall clock to the percent; each assumption is
named where it is used. Symbols as in :mod:`plait.plan.memory` (``B, S, S', h, T, m``, local
widths ``q, k, i, V'``, byte sizes ``c`` compute, ``r`` residual, ``g`` gradient, ``p`` param).

Compute (per pipeline rank; the slowest rank sets the pace)::

    flops = m * B * S * sum over the rank's chunks of
              layers * (6 * layer matmul params + 12 * q * S)     (forward + backward)
            + last stage: 6 * V' * h                              (output head)
    recompute: full checkpointing adds one forward of the layers (a third of their flops);
               selective adds the attention core's forward (4 * q * S per token per layer)
    compute_s = flops / (peak(dtype) * efficiency)

These are the rank's *executed* FLOPs: local shapes include padding heads, K/V heads replicated
over the TP group and the padded vocabulary. ``peak`` is the device's dense peak for the matmul
dtype (``"fp32"`` for the fp32 preset, ``"bf16"`` otherwise) and ``efficiency`` the achievable
share of it for large dense matmuls, :data:`DEFAULT_EFFICIENCY` = 0.5 unless given.

Communication uses ring-algorithm volumes per rank: an all-reduce of ``X`` bytes over ``n`` ranks
moves ``2 (n-1)/n * X``, an all-gather or reduce-scatter of a full size ``X`` moves ``(n-1)/n * X``.
Bandwidths come from the :class:`~plait.devices.DeviceSpec`: within a node ``intra_node_bw / 2``
(the tables quote both directions summed, as NVIDIA does for NVLink; assumed the same for
NeuronLink), across nodes ``inter_node_bw`` (per device, one direction). Latency is ignored.

* TP (per layer per micro-batch, ``A = B * S * h * c``): without SP 2 all-reduces forward and 2
  backward, ``8 (T-1)/T * A``; with SP forward 2 all-gathers + 2 reduce-scatters, backward 2
  reduce-scatters + 2 all-gathers (the row layers' backward) + 2 all-gathers (plait re-gathers the
  column layers' input instead of keeping it): ``10 (T-1)/T * A``. Full checkpointing repeats the
  forward's share. K/V replication ``m_kv > 1`` adds two all-reduces of the K/V gradients over the
  KV group, ``2 * 2 (m_kv-1)/m_kv * B*S*k*c``. First stage: the embedding's all-reduce (under SP
  a reduce-scatter and its backward all-gather) of ``B*S*h*r``, ``2 (T-1)/T * B*S*h*r``; last
  stage: the head's input-gradient all-reduce ``2 (T-1)/T * A`` (under SP the forward gather, the
  backward re-gather and the reduce-scatter, ``3 (T-1)/T * A``). Counted on the slowest rank, not
  overlapped (plait overlaps the backward input-gradient reduction with the weight-gradient
  matmul; ignoring it is conservative).
  Intra-node when the TP group fits in a node.
* DP: the gradient all-reduce ``2 (dp-1)/dp * P * g`` (ZeRO-1: reduce-scatter of the gradients
  plus all-gather of the parameters, ``(dp-1)/dp * P * (g + p)``), over intra-node links when the
  DP group (``T * dp`` consecutive ranks) fits in a node. ``dp_overlap`` of it (default 0.5) is
  assumed hidden behind the backward pass; plait's current coalesced all-reduce after the last
  micro-batch hides none (``dp_overlap=0``).
* PP: each micro-batch sends one activation forward and one gradient backward per chunk
  boundary, ``B * S' * h * r`` bytes each: ``2 * m * vpp * B*S'*h*r / bw`` per rank, counted as
  exposed (plait's receives block the schedule). With tied embeddings and ``pp > 1`` the first and
  last stage all-reduce the embedding gradient (``V' * h * g`` over 2 ranks). Inter-node unless
  the whole job fits in one node.
* Bubble: ``(pp - 1) / (vpp * m + pp - 1)`` (:func:`plait.pipeline.simulate.theoretical_bubble`),
  for ``zb-h1`` ``(pp - 1) / (3m + pp - 1)`` (:func:`plait.pipeline.simulate.schedule_bubble`);
  it stretches the per-rank compute and TP time.

* CP (``ParallelDegrees.cp``; ``S_l = S / cp``, the rank's tokens): compute, TP and PP volumes are those of
  ``S_l`` tokens, except attention, whose queries see the whole sequence (``12 * q * S`` per local
  token, zigzag-balanced). The ring moves per layer per micro-batch ``cp - 1`` K/V blocks
  (``2 * B * S_l * k * c`` each) forward, and in backward ``cp - 1`` blocks plus ``cp`` fp32
  dK/dV accumulators (``2 * B * S_l * k * 4``), again for a recomputed forward; intra-node when
  ``tp * cp`` ranks fit in a node. It overlaps the attention compute: only the excess counts
  (``cp_exposed_s``). The gradient reduction runs over ``dp * cp`` ranks.

* EP (Mixture-of-Experts, :mod:`plait.plan.moe`): a sparse layer's FLOPs per token are its
  router's, its ``k`` active experts' and its shared expert's (whole on every TP rank; balanced
  routing), not the MLP's. Per sparse layer and micro-batch each rank sends ``(ep - 1) * T * k``
  rows of ``h`` per exchange (plait's fixed slots: ``ep`` times the rows it needs), four exchanges
  (tokens and outputs, forward and backward; six under full checkpointing) plus the counts,
  :func:`plait.plan.moe.all_to_all_bytes`, over intra-node links when ``tp * ep`` ranks fit in a
  node (``ep_comm_s``, on the critical path like TP). Expert gradients are reduced over the
  ``dp / ep`` expert-data-parallel ranks (ring volume of the rank's own experts), the rest over
  ``dp``. A sparse layer's TP collectives are its attention half's (half a dense layer's units:
  the MoE layer is whole on every TP rank and communicates nothing over TP without SP). Under
  sequence parallelism each TP rank routes its ``1 / tp`` shard: the router, expert and shared
  expert FLOPs and the all-to-all rows are those of ``T / tp`` tokens, and each micro-batch's
  backward all-reduces the layer's parameter gradients over TP, ``2 (tp-1)/tp * P_moe * p``, plus
  the forward's ``E + 1`` routing counts (:func:`plait.plan.moe.sequence_parallel_tp_bytes`),
  counted in ``tp_comm_s`` (synchronous in the backward, one small all-reduce per parameter).

* Offload (``ParallelDegrees.offload``): the owned gradients to the host and the fp32 weights back
  over the device's host link (``P_own * (g + 4)`` bytes, ``DeviceSpec.host_link_bw``), and the
  host AdamW streaming 28 bytes per owned element at :data:`HOST_UPDATE_BW`, all exposed
  (``offload_s``; :func:`offload_seconds`).

``total_s = (compute_s + tp_comm_s + ep_comm_s) / (1 - bubble_share) + pp_comm_s + (1 - dp_overlap) *
dp_comm_s + cp_exposed_s + offload_s``
and ``mfu = model FLOPs of the step / (total_s * world * peak)`` with PaLM's model FLOPs
(:func:`plait.models.flops.model_flops_per_token`: no recomputation, no padding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from plait.devices import GB, DeviceSpec, peak_flops
from plait.models.decoder.config import DecoderConfig
from plait.models.flops import model_flops_per_token
from plait.pipeline.simulate import schedule_bubble
from plait.plan.degrees import ParallelDegrees
from plait.plan.memory import (
    chunk_expert_parameter_count,
    chunk_parameter_count,
    default_stage_layers,
    ffn_parameter_count,
    layer_matmul_parameter_count,
    local_shapes,
    precision_bytes,
    rank_chunks,
)
from plait.plan.moe import (
    MoEShape,
    active_ffn_matmul_parameters,
    all_to_all_bytes,
    layer_kinds,
    moe_shape,
    sequence_parallel_tp_bytes,
)
from plait.tensor_parallel.heads import HeadLayout

#: achievable share of the dense matmul peak (large GEMMs reach 0.6-0.8 of it on H100; a whole
#: training step with norms, attention and optimizer typically 0.4-0.55)
DEFAULT_EFFICIENCY = 0.5
#: share of the DP gradient reduction hidden behind the backward pass
DEFAULT_DP_OVERLAP = 0.5
#: devices (table entries) per node: 8 GPUs per DGX/HGX node; 16 Trainium chips per
#: trn1.32xlarge / trn2.48xlarge (32 NeuronCores on trn1, but a table entry is one chip and the
#: table's per-device EFA share divides by 16 chips)
DEVICES_PER_NODE = {"h100": 8, "h200": 8, "a100": 8, "trn1": 16, "trn2": 16, "cpu": 1, "cuda": 8}


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one optimizer step of a layout (see the module doc for each term)."""

    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    bubble_share: float
    total_s: float
    mfu: float
    bubble_s: float = 0.0         # seconds the bubble adds to total_s
    dp_exposed_s: float = 0.0     # (1 - dp_overlap) * dp_comm_s, what total_s counts
    flops_per_rank: float = 0.0   # executed FLOPs of the slowest rank (recompute and padding included)
    model_flops: float = 0.0      # PaLM model FLOPs of the whole step (all ranks)
    peak_flops: float = 0.0       # per device, the dtype used
    efficiency: float = DEFAULT_EFFICIENCY
    cp_comm_s: float = 0.0        # the ring's point-to-point transfers (context parallelism)
    cp_exposed_s: float = 0.0     # the part of them not hidden behind the attention compute
    ep_comm_s: float = 0.0        # MoE: the expert all-to-alls of the slowest rank (dispatch and combine)
    ep_bytes: float = 0.0         # MoE: bytes that rank sends over its expert group in the step
    offload_s: float = 0.0        # optimizer offload: gradients to the host, the host update, weights back

    def as_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def table_header() -> str:
        cols = ["compute s", "TP s", "DP s", "PP s", "bubble", "total s", "MFU"]
        return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)

    def table_row(self) -> str:
        return (f"| {self.compute_s:.4g} | {self.tp_comm_s:.4g} | {self.dp_comm_s:.4g} | {self.pp_comm_s:.4g} | "
                f"{self.bubble_share:.1%} | {self.total_s:.4g} | {self.mfu:.1%} |")


def _ring(n: int) -> float:
    """``(n - 1) / n``: the share of a buffer each rank moves in a ring all-gather / reduce-scatter."""
    return (n - 1) / n if n > 1 else 0.0


def _bandwidth(device: DeviceSpec, intra: bool, what: str) -> float:
    bw = (device.intra_node_bw / 2 if device.intra_node_bw else None) if intra else device.inter_node_bw
    if not bw:
        kind = "intra_node_bw" if intra else "inter_node_bw"
        raise ValueError(f"device {device.name!r} has no {kind} in the device table, needed for {what}; "
                         f"pass a DeviceSpec with bandwidths")
    return bw


def rank_flops(config: DecoderConfig, layout: ParallelDegrees, seq_len: int, micro_batch_size: int, microbatches: int,
               pp_rank: int, stage_layers: list[list[int]] | None = None) -> float:
    """Executed FLOPs of one rank for a step (module doc: compute), recomputation included."""
    sh = local_shapes(config, layout)
    tokens = microbatches * micro_batch_size * seq_len // layout.cp  # the rank's share under context parallelism
    moe = moe_shape(config)
    if moe is not None:
        return _moe_rank_flops(config, layout, seq_len, tokens, pp_rank, stage_layers)
    per_layer = 6 * layer_matmul_parameter_count(config, sh) + 12 * sh.q * seq_len
    recompute = {"none": 0.0, "full": per_layer / 3, "selective": 4 * sh.q * seq_len}[layout.activation_checkpointing]
    total = 0.0
    for ch in rank_chunks(config, layout, seq_len, pp_rank, stage_layers=stage_layers):
        total += len(ch.layers) * (per_layer + recompute)
        if ch.last:
            total += 6 * sh.vocab * sh.hidden
    return total * tokens


def _moe_rank_flops(config: DecoderConfig, layout: ParallelDegrees, seq_len: int, tokens: int, pp_rank: int,
                    stage_layers: list[list[int]] | None) -> float:
    """:func:`rank_flops` of an MoE family: per token, a sparse layer's router, ``k`` experts and
    shared expert (whole on every TP rank, which all repeat them; under sequence parallelism each
    TP rank computes them for its ``1 / tp`` shard of the tokens) instead of the MLP; balanced
    routing (each rank of an expert group computes, on average, its own tokens' share)."""
    moe = moe_shape(config)
    assert moe is not None
    sh = local_shapes(config, layout)
    shard = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1  # the tokens' share a TP rank routes
    total = 0.0
    for ch in rank_chunks(config, layout, seq_len, pp_rank, stage_layers=stage_layers):
        if ch.last:
            total += 6 * sh.vocab * sh.hidden
        for layer, count in layer_kinds(moe, ch.layers):
            attention = layer_matmul_parameter_count(config, sh, layer) - ffn_parameter_count(config, moe, sh, layer)
            ffn = active_ffn_matmul_parameters(config, moe, layer, layout.tp) / (shard if moe.is_sparse(layer) else 1)
            per_layer = 6 * (attention + ffn) + 12 * sh.q * seq_len
            total += count * (per_layer + {"none": 0.0, "full": per_layer / 3,
                                           "selective": 4 * sh.q * seq_len}[layout.activation_checkpointing])
    return total * tokens


def estimate_step_time(config: DecoderConfig, layout: ParallelDegrees, device: DeviceSpec, *,
                       precision: str = "autocast", micro_batch_size: int, seq_len: int, microbatches: int,
                       nodes_of: Callable[[int], int] | None = None, devices_per_node: int | None = None,
                       efficiency: float = DEFAULT_EFFICIENCY, dp_overlap: float = DEFAULT_DP_OVERLAP,
                       peak: float | None = None, stage_layers: list[list[int]] | None = None) -> TimeBreakdown:
    """Estimated seconds of one optimizer step of ``layout`` on ``device`` (see the module doc).

    ``devices_per_node`` defaults to :data:`DEVICES_PER_NODE` for the device (8 otherwise);
    ``nodes_of(world)`` gives the number of nodes a world occupies (default
    ``ceil(world / devices_per_node)``), from which the devices per node actually used follow.
    ``peak`` overrides the device's peak FLOP/s for the dtype (measured devices otherwise run
    :func:`plait.devices.peak_flops`'s probe).
    """
    pb = precision_bytes(precision)
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must be in (0, 1]")
    if not 0 <= dp_overlap <= 1:
        raise ValueError(f"dp_overlap={dp_overlap!r} must be in [0, 1]")
    for name, v in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len), ("microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    world = layout.world
    per_node_cap = devices_per_node or DEVICES_PER_NODE.get(device.name, 8)
    nodes = nodes_of(world) if nodes_of is not None else math.ceil(world / per_node_cap)
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes_of({world}) = {nodes!r} must be a positive integer")
    per_node = math.ceil(world / nodes)
    dtype = "fp32" if precision == "fp32" else "bf16"
    peak = peak if peak is not None else peak_flops(device, dtype)

    if layout.pp * layout.vpp > 1 and stage_layers is None:
        stage_layers = default_stage_layers(config, layout.pp * layout.vpp, seq_len)
    sh = local_shapes(config, layout)
    B, S_full, m, T = micro_batch_size, seq_len, microbatches, layout.tp
    S = S_full // layout.cp  # the rank's tokens of each sequence (context parallelism)
    sp = layout.sequence_parallel and T > 1
    S_r = -(-S // T) if sp else S
    A = B * S * sh.hidden * pb.compute

    # TP volume per micro-batch of one layer, and of the first / last stage's extras
    if T > 1:
        tp_bw = _bandwidth(device, T <= per_node, "tensor-parallel collectives")
        layer_units = 10 if sp else 8
        if layout.activation_checkpointing == "full":
            layer_units += 4  # the recomputed forward: 2 AG + 2 RS, or 2 all-reduces (2 * 2)
        layer_tp = layer_units * _ring(T) * A
        # an MoE family's sparse layer: the attention half's collectives only (the MoE layer is whole
        # on every TP rank: none in it); under sequence parallelism its gradient sum is added below
        sparse_tp = (layer_units // 2) * _ring(T) * A
        heads = layout.kv_replication if layout.kv_replication > 1 else None
        m_kv = HeadLayout.plan(config.num_attention_heads, config.num_key_value_heads, config.head_dim, T,
                               heads).kv_replication
        if m_kv > 1:
            kv_tp = 2 * 2 * _ring(m_kv) * B * S * sh.kv * pb.compute
            layer_tp += kv_tp
            sparse_tp += kv_tp
        first_tp = 2 * _ring(T) * B * S * sh.hidden * pb.residual  # all-reduce, or RS + its backward AG
        last_tp = (3 if sp else 2) * _ring(T) * A  # dx all-reduce; or AG, re-gather and dx RS
    else:
        tp_bw, layer_tp, first_tp, last_tp, sparse_tp = 1.0, 0.0, 0.0, 0.0, 0.0

    # MoE: the expert group's all-to-all bytes per sparse layer and micro-batch (0 at ep = 1), of
    # the rank's routed tokens (its sequence shard under sequence parallelism)
    moe = moe_shape(config)
    layer_a2a = 0.0 if moe is None else all_to_all_bytes(
        moe, sh.hidden, B * S_r, layout.ep, compute=pb.compute, residual=pb.residual,
        recompute=layout.activation_checkpointing == "full")
    if moe is not None and sp:
        sparse_tp += sequence_parallel_tp_bytes(moe, sh.hidden, layout.ep, T, grad=pb.param)
    ep_bw = _bandwidth(device, T * layout.cp * layout.ep <= per_node, "the expert all-to-all") if layer_a2a else 1.0

    slowest = (0.0, 0.0, 0.0, 0.0, 0.0)  # (compute + tp + ep, compute, tp, ep, ep bytes)
    slowest_flops = 0.0
    max_params = max_experts = 0
    for r in range(layout.pp):
        chunks = rank_chunks(config, layout, S_full, r, stage_layers=stage_layers)
        flops = rank_flops(config, layout, S_full, B, m, r, stage_layers)
        comp = flops / (peak * efficiency)
        vol = sum(_layers_tp(moe, ch.layers, layer_tp, sparse_tp) + (first_tp if ch.first else 0)
                  + (last_tp if ch.last else 0) for ch in chunks) * m
        tp_s = vol / tp_bw if T > 1 else 0.0
        a2a = 0.0
        if moe is not None and layer_a2a:
            a2a = sum(layer_a2a for ch in chunks for layer in ch.layers if moe.is_sparse(layer)) * m
        ep_s = a2a / ep_bw
        if comp + tp_s + ep_s > slowest[0]:
            slowest, slowest_flops = (comp + tp_s + ep_s, comp, tp_s, ep_s, a2a), flops
        max_params = max(max_params, sum(chunk_parameter_count(config, sh, ch) for ch in chunks))
        if moe is not None:
            max_experts = max(max_experts, sum(chunk_expert_parameter_count(config, sh, ch) for ch in chunks))
    _, compute_s, tp_comm_s, ep_comm_s, ep_bytes = slowest

    dp = layout.dp * layout.cp  # the ranks that average gradients
    if dp > 1:
        dp_bw = _bandwidth(device, T * dp <= per_node, "the data-parallel gradient reduction")
        units = _dp_units(layout.zero, pb, m)
        if layout.ep > 1:  # expert gradients: over the expert-data-parallel group of dp / ep ranks
            dp_vol = _ring(dp) * (max_params - max_experts) * units + _ring(dp // layout.ep) * max_experts * units
        else:
            dp_vol = _ring(dp) * max_params * units
        dp_comm_s = dp_vol / dp_bw
    else:
        dp_comm_s = 0.0

    if layout.pp > 1:
        pp_bw = _bandwidth(device, world <= per_node, "pipeline point-to-point transfers")
        pp_vol: float = 2 * m * layout.vpp * B * S_r * sh.hidden * pb.residual
        if config.last_stage_holds_embedding():
            pp_vol += 2 * _ring(2) * sh.vocab * sh.hidden * pb.grad
        pp_comm_s = pp_vol / pp_bw
        bubble = schedule_bubble(layout.schedule, layout.pp, m, layout.vpp)
    else:
        pp_comm_s, bubble = 0.0, 0.0

    cp_comm_s = cp_exposed = 0.0
    if layout.cp > 1:
        cp = layout.cp
        block = 2 * B * S * sh.kv
        forwards = 2 if layout.activation_checkpointing == "full" else 1
        per_layer = (forwards * (cp - 1) * block * pb.compute + (cp - 1) * block * pb.compute + cp * block * 4) * m
        layers = max(sum(len(ch.layers) for ch in rank_chunks(config, layout, S_full, r, stage_layers=stage_layers))
                     for r in range(layout.pp))
        cp_comm_s = layers * per_layer / _bandwidth(device, T * cp <= per_node, "the context-parallel ring")
        attention_s = layers * 12 * sh.q * S_full * B * S * m / (peak * efficiency)
        cp_exposed = max(0.0, cp_comm_s - attention_s)

    offload_s = 0.0
    if layout.offload:
        owned = max_params / dp if layout.zero and dp > 1 else max_params
        offload_s = offload_seconds(device, owned, pb.grad)
    stage_s = (compute_s + tp_comm_s + ep_comm_s) / (1 - bubble)
    dp_exposed = (1 - dp_overlap) * dp_comm_s
    total = stage_s + pp_comm_s + dp_exposed + cp_exposed + offload_s
    model_flops = float(model_flops_per_token(config, S_full)) * B * S_full * m * layout.dp
    mfu = model_flops / (total * world * peak)
    bubble_s = stage_s - compute_s - tp_comm_s - ep_comm_s
    return TimeBreakdown(compute_s=compute_s, tp_comm_s=tp_comm_s, dp_comm_s=dp_comm_s, pp_comm_s=pp_comm_s,
                         bubble_share=bubble, total_s=total, mfu=mfu, bubble_s=bubble_s,
                         dp_exposed_s=dp_exposed, flops_per_rank=slowest_flops, model_flops=model_flops,
                         peak_flops=peak, efficiency=efficiency, cp_comm_s=cp_comm_s, cp_exposed_s=cp_exposed,
                         ep_comm_s=ep_comm_s, ep_bytes=ep_bytes, offload_s=offload_s)


#: host memory bandwidth one rank's AdamW update streams at (an assumption: a two-socket host's
#: ~300 GB/s shared by 8 devices, less the other traffic); the update reads weight, gradient and
#: both moments and writes weight and moments: 28 bytes per fp32 element
HOST_UPDATE_BW = 25 * GB
HOST_UPDATE_BYTES = 28


def offload_seconds(device: DeviceSpec, owned: float, grad_bytes: int) -> float:
    """Seconds optimizer offload adds to a step: the owned gradients to the host, the host AdamW
    over them, the fp32 weights back (priced one after the other, none hidden: the update sits
    between the step's backward and the next forward). A CPU device's host is its own memory:
    the copies are priced as memory traffic."""
    link = device.host_link_bw if device.name != "cpu" else HOST_UPDATE_BW
    if not link:
        raise ValueError(f"device {device.name!r} has no host_link_bw in the device table, needed to price "
                         f"optimizer offload; pass a DeviceSpec with it")
    return owned * (grad_bytes + 4) / link + owned * HOST_UPDATE_BYTES / HOST_UPDATE_BW


def _dp_units(level: int, pb, microbatches: int) -> float:
    """Bytes each parameter element moves per ring step and step, by ZeRO level: an all-reduce of
    the gradient (0); a reduce-scatter of it and an all-gather of the updated weight (1); ZeRO-2's
    reduce-scatter after every micro-batch's backward, then the all-gather (2); ZeRO-3's two weight
    all-gathers (before forward and again before backward) and a gradient reduce-scatter per
    micro-batch (3)."""
    if level == 0:
        return 2 * pb.grad
    if level == 1:
        return pb.grad + pb.param
    if level == 2:
        return microbatches * pb.grad + pb.param
    return microbatches * (pb.grad + 2 * pb.param)


def _layers_tp(moe: MoEShape | None, layers: tuple[int, ...], dense: float, sparse: float) -> float:
    """TP bytes of ``layers`` per micro-batch: ``dense`` per decoder layer, ``sparse`` per MoE layer."""
    if moe is None:
        return len(layers) * dense
    n = sum(1 for layer in layers if moe.is_sparse(layer))
    return (len(layers) - n) * dense + n * sparse


__all__ = ["DEFAULT_DP_OVERLAP", "DEFAULT_EFFICIENCY", "DEVICES_PER_NODE", "TimeBreakdown", "estimate_step_time",
           "rank_flops"]
