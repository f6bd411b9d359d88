"""Per-rank memory model of a training step: model states, saved activations, buffers.

:func:`estimate_memory` prices one pipeline rank (or the worst one) of a :class:`ParallelDegrees` in
bytes, component by component, following what plait's code allocates (checked against the
tensors a real forward leaves alive in ``tests/test_plan_memory.py`` and against measured peak
RSS in ``docs/plan_memory.md``).

Notation: ``B`` micro-batch size, ``S`` sequence length, ``h`` hidden size, ``T`` the TP degree,
``m`` micro-batches per step; per TP rank ``q = local_q_heads * head_dim`` (padding heads
included), ``k = local_kv_heads * head_dim`` (K/V replication included), ``n_q`` local query heads,
``i = intermediate_size / T``, ``V' = ceil(vocab / T)`` (the vocabulary padded to a multiple of
``T``; exactly ``vocab`` at ``T = 1``, where plait does not swap in parallel modules): the
family's own widths (:func:`local_shapes`, from ``ModelFamily.local_shapes``, as its ``parallelize``
builds them). ``S' = S / T`` under sequence parallelism, else ``S``. Byte sizes per precision preset
(:data:`PRECISIONS`, following :mod:`plait.precision`): ``p`` parameter, ``g`` gradient
buffer (fp32 under ``bf16-mixed``: gradients are accumulated and reduced in fp32), ``o`` one
optimizer state (the dtype the optimizer updates), ``w`` master weight, ``c`` compute (matmul
inputs, attention, MLP), ``r`` residual stream (pipeline transfers).

Model states follow :class:`plait.data_parallel.optimizer.DistributedOptimizer` (per rank,
``P`` = local parameters, :func:`rank_parameter_count`; ``P_own = ceil(P / dp)`` with ZeRO-1 and
``dp > 1``, else ``P``)::

    parameters     = P * p          the flat parameter buffer the weights are views of
    gradients      = P * g          the flat gradient buffer: allocated once, alive the whole step
                                    (zeroed in place after the update, never freed)
    gradient_shard = P_own * g      ZeRO-1 only: the reduce-scatter target holding the averaged
                                    gradients of the owned shard (0 without ZeRO-1)
    optimizer      = 2 * P_own * o  AdamW exp_avg, exp_avg_sq of the owned elements
    master_weights = P * 4          bf16-mixed without ZeRO-1 (the fp32 master copy)
                   = P_own * 4      bf16-mixed with ZeRO-1 (the owned shard of it)
                   = 0              other presets: the optimizer updates the weights (with ZeRO-1
                                    their owned range of the parameter buffer) in place

With optimizer offload (``ParallelDegrees.offload``) ``optimizer`` and ``master_weights`` are 0
on the device and ``host_bytes = 16 * P_own`` (fp32 moments, master and the host copy of the owned
gradients) lives in host memory instead; ``total`` is the device's.

Padding that makes buckets divide by ``dp`` (at most ``dp - 1`` elements per bucket) is ignored.

Activations are the tensors autograd saves, per micro-batch (:func:`layer_activation_bytes`
for one decoder layer, :func:`chunk_cost` for a chunk), times the micro-batches in flight on the
rank at the peak, found by walking the rank's schedule (:func:`schedule_peak`; 1F1B holds at most
``min(pp - r, m)``, GPipe ``m``, interleaved 1F1B what its task list gives; without pipeline
parallelism one). The other activation-phase fields, at that same peak:

* ``gradients_at_peak``: the gradient buffer, always whole (``== gradients``). Before the flat
  buffer, ``.grad`` tensors were freed by ``zero_grad`` and existed only after a chunk's first
  backward; they no longer are.
* ``weight_copies``: autocast's bf16 copies of the matmul weights, saved for backward once per
  in-flight micro-batch (``2 * matmul weights`` per chunk: biases are cast but not kept); 0 without
  autocast.
* ``logits``: last stage only, per in-flight micro-batch: what the loss saves for backward. At
  ``T = 1`` (``F.cross_entropy`` on ``logits.float()``) the fp32 log-softmax, ``4 * B * S * V'``;
  the chunked vocab-parallel loss (:mod:`plait.tensor_parallel.cross_entropy`, ``T > 1`` or
  ``cp > 1``) the logits it is given and two fp32 numbers per token, ``(c * N * V' + 8 * N)``
  under TP and ``(4 * N * V' + 8 * N)`` under cp (its output module hands the loss an fp32 copy).
* ``comm_buffers``: pipeline p2p buffers as plait's runtime keeps them (a sent activation is
  held until its gradient comes back, i.e. while its micro-batch is in flight on a non-last
  chunk; a sent input gradient until the step's end; one received gradient during a backward;
  ``B * S' * h * r`` each) and, under sequence parallelism, one gathered ``[B, S, h]`` input in
  the compute dtype (the all-gather of a column-parallel layer). TP all-reduces run in place:
  counted 0.
* ``workspace``: the transient at the peak: the loss's working set on the last stage, or a new
  weight gradient (autograd's, in the parameter dtype ``p``) before the post-accumulate hook adds
  it into the flat buffer and frees it (:func:`chunk_cost`).

Context parallelism (``ParallelDegrees.cp``): every activation term is priced at the rank's local sequence
``S / cp`` (the ring computes attention without an ``S x S`` matrix, as flash SDPA); ZeRO-1 shards
over the ``dp * cp`` ranks that average gradients; ``comm_buffers`` adds the ring's blocks in flight
during one layer's attention backward (the K/V block at hand and the one arriving, the dK/dV
accumulator arriving, the one leaving and the block's own, fp32: ``5 * 2 * B * (S / cp) * k * 4``).
plait's attention kernel (CPU math, :mod:`plait.context_parallel.blocks`) materialises each piece's
scores (``(S / 2cp)^2`` per local query head, fp32): a piece's backward holds five such tensors and
the diagonal mask (:func:`plait.context_parallel.plan.attention_workspace_bytes`), priced as a
``backward_transient`` less what the micro-batch has released before the last layer's attention
backward (the loss's saved logits, the final norm and head input, and without checkpointing the last
layer's MLP half). Measured within 5% at cp=2/4 (docs/context_parallel.md). The loss under cp is
priced as the vocab-parallel one (:class:`plait.context_parallel.sequence_loss.ContextParallelOutput` runs
it at any TP degree).

Mixture-of-Experts families (:mod:`plait.plan.moe`; ``ParallelDegrees.ep``, ``E`` experts of width ``w``
per sparse layer, top-``k``): a sparse layer holds its router (and shared expert) whole on every
rank and ``E / ep`` whole experts (not split over TP: plait repeats the expert work on the TP
ranks), a dense layer of the family Llama's TP-split MLP; the routed experts
(``MemoryBreakdown.expert_parameter_count``) are ZeRO-1-sharded over the ``dp / ep``
expert-data-parallel ranks, the rest over ``dp``: ``P_own = ceil(P_dense / dp) + ceil(P_experts /
(dp / ep))`` when ``ep > 1``. A sparse layer's saved activations replace the MLP's with the routing
tensors, the dispatch indices, the expert-side rows (``ep * T * k`` under expert parallelism: one
fixed slot of ``T * k`` rows per peer) and their SwiGLU tensors, and the fp32 combine;
``weight_copies`` adds the grouped matmul's stacked local expert weights (every preset) and the
router's fp32 upcast (bf16 presets); ``comm_buffers`` one layer's exchange send and receive
buffers; ``workspace`` the stacked expert-weight gradient. Under sequence parallelism each TP rank's
sparse layer routes only its sequence shard, so the MoE block's activations and exchange buffers
are those of ``B * S'`` tokens (without it every TP rank holds all ``B * S``), and the backward's
workspace adds the copy of one expert projection's gradient that the TP gradient sum makes
(:func:`plait.moe.sequence_parallel.sum_moe_gradients_over_tp` clones it to all-reduce).
Measured against autograd's saved tensors (a sequence shard's included) and the optimizer's
buffers in ``tests/test_plan_moe.py``.

After the last backward (activations gone) the step phase needs the gradient buffer plus
``step_buffers``, the largest of these transients (they do not overlap in time):

* the gradient norm: ``torch._foreach_norm`` over the owned gradient segments allocates nothing
  for fp32 gradients; bf16 gradients (``bf16-pure``) are first copied to fp32, all at once:
  ``4 * P_own``;
* the update: fused ``torch.optim.AdamW`` allocates nothing beyond its states (checked on the
  CPU); ``LowPrecisionAdamW`` (bf16 state, ``bf16-pure``) works on fp32 copies of one segment at
  a time: ``8 * 4`` bytes per element of the largest owned segment (weight, both moments,
  gradient, the denominator, the rounding noise, its sum and the shifted bits). Without ZeRO-1
  that is the largest weight; with it, a weight larger than a bucket (``BUCKET_MB``, the default
  ``parallel.bucket_mb``) is split ``dp`` ways (a routed expert's ``dp / ep`` ways: expert buckets
  are sharded over the expert-data-parallel ranks);
* ZeRO-1: the all-gather of the updated shards stages every bucket's owned shard in the
  parameter dtype before waiting for the gathers: ``P_own * p``.

The data-parallel reductions themselves run in place on the flat buffer (all-reduce) or into the
shard buffer (reduce-scatter); what a collective library stages internally is not modelled.

``total = parameters + optimizer + master_weights + gradient_shard + max(activation phase, step
phase)`` with ``activation phase = gradients_at_peak + activations + weight_copies + logits +
comm_buffers + workspace`` and ``step phase = gradients + step_buffers``.

Not modelled: allocator caching and fragmentation (the CUDA caching allocator, glibc arenas), the
CUDA context / NCCL buffers, backward-pass transients other than ``workspace`` (each layer's
activation gradients, a few ``[B, S, i]`` tensors), int64 token ids and masks, collective
libraries' internal staging copies, bucket padding.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from plait.context_parallel.plan import attention_workspace_bytes, ring_buffer_bytes
from plait.models.decoder.config import DecoderConfig
from plait.models.decoder.shapes import BlockShape, LocalShapes
from plait.models.registry import family_of
from plait.pipeline.schedules import compute_order
from plait.pipeline.tasks import Forward, WeightGrad
from plait.plan.adapters import AdapterPlan, adapter_states
from plait.plan.block import (
    attention_parameter_count,
    bias_parameter_count,
    block_of,
    block_parameter_count,
    extra_parameters,
    llama_block,
    norm_parameter_count,
    qkv_weight_sizes,
)
from plait.plan.degrees import ParallelDegrees
from plait.plan.moe import (
    MoEShape,
    attention_extra_parameters,
    expert_parameter_count,
    layer_kinds,
    local_experts,
    moe_activation_bytes,
    moe_comm_buffer_bytes,
    moe_shape,
    moe_weight_copies,
    shared_parameter_count,
)
from plait.plan.pipeline_split import plan_partition
from plait.tensor_parallel.cross_entropy import default_chunk_rows

MiB = 1024**2
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each kind of tensor under one precision preset (see module doc)."""

    name: str
    param: int
    grad: int
    optimizer_state: int
    master: int
    compute: int
    residual: int
    autocast: bool


#: ``fp32``: everything fp32. ``autocast``: fp32 weights, gradients and residual stream, bf16
#: matmuls/attention/MLP (torch.autocast). ``bf16-mixed``: bf16 weights, activations and
#: autograd's per-parameter gradients, but an fp32 gradient buffer (accumulation and the
#: data-parallel reduction run in fp32), fp32 master weights and optimizer states: 2 + 4 + 4 + 8
#: bytes per parameter (the ZeRO paper's 2 + 2 + 12 assumed bf16 gradients). ``bf16-pure``:
#: everything bf16, optimizer states included. ``master`` is the master copy's bytes per owned
#: element (bf16-mixed only; its owned shard under ZeRO-1, see the module doc).
PRECISIONS: dict[str, PrecisionBytes] = {
    "fp32": PrecisionBytes("fp32", 4, 4, 4, 0, 4, 4, False),
    "autocast": PrecisionBytes("autocast", 4, 4, 4, 0, 2, 4, True),
    "bf16-mixed": PrecisionBytes("bf16-mixed", 2, 4, 4, 4, 2, 2, False),
    "bf16-pure": PrecisionBytes("bf16-pure", 2, 2, 2, 0, 2, 2, False),
}


def precision_bytes(precision: str) -> PrecisionBytes:
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"precision={precision!r} is not valid; valid: {', '.join(map(repr, PRECISIONS))}") from None


# ------------------------------------------------------------------------------ local shapes
def local_shapes(config: DecoderConfig, layout: ParallelDegrees) -> LocalShapes:
    """Local sizes exactly as the family's ``parallelize`` builds them: its ``local_shapes``
    (:class:`~plait.models.family.ModelFamily`; Llama's plan, which Qwen3, Mistral and the MoE
    families reuse, :func:`plait.models.llama.parallelize.local_shapes`) at ``layout.tp`` and
    ``layout.kv_replication`` (1: the plan's automatic factor), with ``layout.ep``.
    """
    shapes = family_of(config).local_shapes(config, layout.tp, layout.kv_replication)
    return dataclasses.replace(shapes, ep=layout.ep)


def layer_parameter_count(config: DecoderConfig, sh: LocalShapes, layer: int | None = None) -> int:
    """Local parameters of one decoder layer (the family's block, :mod:`plait.plan.block`): q/k/v,
    separate or fused (+ biases), o (+ replicated bias), the MLP's column projections (+ biases) and
    its row projection (+ replicated bias), two norms (weights, and biases for layer norms), and what
    the family adds to those parts.

    MoE families (:mod:`plait.plan.moe`, Llama's block): decoder layer ``layer``'s own feed-forward
    part, a sparse layer's router and shared expert whole and ``experts / ep`` whole experts, a dense
    layer's tensor-parallel MLP; ``layer`` is then required."""
    if moe_shape(config) is None:
        return block_parameter_count(block_of(config), sh) + family_extra_parameters(config)
    c, block = llama_block(config), block_of(config)
    moe = moe_shape(c)
    assert moe is not None
    if layer is None:
        raise ValueError("an MoE model's layers differ: give the decoder layer")
    return (attention_parameter_count(block, sh) + norm_parameter_count(block, sh) + family_extra_parameters(c)
            + ffn_parameter_count(c, moe, sh, layer))


def ffn_parameter_count(config: DecoderConfig, moe: MoEShape, sh: LocalShapes, layer: int) -> int:
    """MoE family: a sparse layer's router, shared expert and local experts, or a dense layer's
    local MLP (the feed-forward part of :func:`layer_parameter_count`)."""
    h = sh.hidden
    if moe.is_sparse(layer):
        return shared_parameter_count(moe, h) + expert_parameter_count(moe, h, sh.ep)
    i = config.intermediate_size // sh.tp
    return 3 * h * i + ((2 * i + h) if llama_block(config).mlp_bias else 0)


def layer_expert_parameter_count(config: DecoderConfig, sh: LocalShapes, layer: int) -> int:
    """The routed experts' part of :func:`layer_parameter_count` (0 for a dense layer or model):
    the parameters reduced and ZeRO-1-sharded over the expert-data-parallel group."""
    moe = moe_shape(config)
    if moe is None or not moe.is_sparse(layer):
        return 0
    return expert_parameter_count(moe, sh.hidden, sh.ep)


def family_extra_parameters(config: DecoderConfig) -> int:
    """Parameters a family's block adds to the parts of its :class:`BlockShape` (Qwen3's per-head
    q/k norm weights): small tensors replicated on every TP rank, read by no matmul. For an MoE
    family, whose ``layer_parameters`` counts experts, the part besides the feed-forward layer."""
    if moe_shape(config) is not None:
        return attention_extra_parameters(config)
    return extra_parameters(config)


def layer_matmul_parameter_count(config: DecoderConfig, sh: LocalShapes, layer: int | None = None) -> int:
    """The part of :func:`layer_parameter_count` that matmuls read (everything but the norms)."""
    return (layer_parameter_count(config, sh, layer) - norm_parameter_count(block_of(config), sh)
            - family_extra_parameters(config))


def layer_weight_copy_count(config: DecoderConfig, sh: LocalShapes) -> int:
    """Elements of a dense layer's matmul weights that autocast copies to the compute dtype and
    keeps for backward: :func:`layer_matmul_parameter_count` without the biases (cast too, but not
    saved: a bias's gradient needs no input)."""
    return layer_matmul_parameter_count(config, sh) - bias_parameter_count(block_of(config), sh)


@dataclass(frozen=True)
class Chunk:
    """One model chunk (global pipeline stage) held by a rank."""

    stage: int
    layers: tuple[int, ...]
    first: bool
    last: bool


def rank_chunks(config: DecoderConfig, layout: ParallelDegrees, seq_len: int, pp_rank: int, *,
                stage_layers: list[list[int]] | None = None) -> list[Chunk]:
    """The chunks pipeline rank ``pp_rank`` holds: global stages ``pp_rank, pp_rank + pp, ...``.

    The split is :func:`plait.plan.pipeline_split.plan_partition` (balanced, FLOP cost), as the
    trainer's default recipe uses, unless ``stage_layers`` is given. ``pp * vpp == 1``: one chunk
    with every layer, first and last.
    """
    n = layout.pp * layout.vpp
    if n == 1:
        return [Chunk(0, tuple(range(config.num_hidden_layers)), True, True)]
    if stage_layers is None:
        stage_layers = default_stage_layers(config, n, seq_len)
    return [Chunk(s, tuple(stage_layers[s]), s == 0, s == n - 1) for s in range(pp_rank, n, layout.pp)]


def default_stage_layers(config: DecoderConfig, num_stages: int, seq_len: int) -> list[list[int]]:
    """:func:`plait.plan.pipeline_split.plan_partition`'s balanced FLOP split (the trainer's default),
    cached per (config, stages, sequence length): a layout search prices many layouts."""
    return [list(s) for s in _cached_split(repr(config), config, num_stages, seq_len)]


_SPLITS: dict[tuple[str, int, int], tuple[tuple[int, ...], ...]] = {}


def _cached_split(key: str, config: DecoderConfig, num_stages: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    k = (key, num_stages, seq_len)
    if k not in _SPLITS:
        split = plan_partition(config, num_stages, seq_len, method="balanced", cost="flops").stage_layers()
        if len(_SPLITS) > 256:
            _SPLITS.clear()
        _SPLITS[k] = tuple(tuple(s) for s in split)
    return _SPLITS[k]


def chunk_parameter_count(config: DecoderConfig, sh: LocalShapes, chunk: Chunk) -> int:
    """Local parameters of one chunk: its layers; the embedding on the first stage, and on the last
    stage too when it keeps a copy (``config.last_stage_holds_embedding``: tied embeddings, or
    DeepSeek-V3's prediction modules; summed over both ends before the data-parallel reduction, see
    :mod:`plait.data_parallel.grad_sync`); the final norm, the output head (unless tied: then it is
    the embedding) and the tail modules (:func:`tail_parameter_count`) on the last."""
    moe = moe_shape(config)
    if moe is None:
        n = len(chunk.layers) * layer_parameter_count(config, sh)
    else:
        n = sum(count * layer_parameter_count(config, sh, layer) for layer, count in layer_kinds(moe, chunk.layers))
    embed = sh.vocab * sh.hidden
    if chunk.first or (chunk.last and config.last_stage_holds_embedding()):
        n += embed
    if chunk.last:
        n += config.final_norm_parameters() + (0 if config.tie_word_embeddings else embed)
        n += tail_parameter_count(config, sh)
    return n


def tail_parameter_count(config: DecoderConfig, sh: LocalShapes) -> int:
    """Local parameters of the blocks the last stage runs after the decoder (``config.tail_layer_ids``:
    DeepSeek-V3's multi-token prediction), each priced as the block of its layer id, and of their
    replicated extras (``config.tail_extra_parameters``)."""
    tail = config.tail_layer_ids()
    if not tail:
        return 0
    if moe_shape(config) is None:
        blocks = len(tail) * layer_parameter_count(config, sh)
    else:
        blocks = sum(layer_parameter_count(config, sh, layer) for layer in tail)
    return blocks + config.tail_extra_parameters()


def chunk_expert_parameter_count(config: DecoderConfig, sh: LocalShapes, chunk: Chunk) -> int:
    """Routed-expert parameters of one chunk (0 for a dense model)."""
    moe = moe_shape(config)
    if moe is None:
        return 0
    layers = chunk.layers + (tuple(config.tail_layer_ids()) if chunk.last else ())
    return sum(1 for layer in layers if moe.is_sparse(layer)) * expert_parameter_count(moe, sh.hidden, sh.ep)


def rank_parameter_count(config: DecoderConfig, layout: ParallelDegrees, seq_len: int, pp_rank: int = 0) -> int:
    """Exact local parameter count of one rank (every TP rank of a stage holds the same count)."""
    sh = local_shapes(config, layout)
    return sum(chunk_parameter_count(config, sh, ch) for ch in rank_chunks(config, layout, seq_len, pp_rank))


def _largest_weights(config: DecoderConfig, sh: LocalShapes, chunks: list[Chunk]) -> tuple[int, int]:
    """Elements of the rank's largest weight outside the routed experts, and of its largest routed
    expert weight (0 without one): the two are sharded over different groups under ZeRO-1."""
    sizes = []
    moe = moe_shape(config)
    dense_layers = any(moe is None or not moe.is_sparse(layer) for ch in chunks for layer in ch.layers)
    if any(ch.layers for ch in chunks):
        sizes += qkv_weight_sizes(block_of(config), sh)
    if dense_layers:
        sizes.append(sh.hidden * sh.intermediate)
    if any(ch.first or ch.last for ch in chunks):
        sizes.append(sh.vocab * sh.hidden)
    expert = 0
    if moe is not None and any(moe.is_sparse(layer) for ch in chunks for layer in ch.layers):
        sizes += [moe.experts * sh.hidden, sh.hidden * moe.shared_width]  # the router, a shared expert projection
        expert = sh.hidden * moe.width  # one expert projection
    return max(sizes, default=0), expert


#: ``parallel.bucket_mb``'s default: the size of a data-parallel bucket, in gradient bytes
BUCKET_MB = 25.0


def _largest_segment(largest_weight: int, shards: int, grad_bytes: int) -> int:
    """Elements of the largest piece of one weight the optimizer updates on a rank.

    Without sharding it is the whole weight. With ZeRO-1 a weight larger than a bucket has a
    bucket of its own, split into ``shards`` equal pieces; a smaller one shares a bucket and lies
    in at most ``bucket / shards`` elements of one shard (an upper bound).
    """
    if shards == 1:
        return largest_weight
    bucket = int(BUCKET_MB * 2**20 / grad_bytes)
    if largest_weight > bucket:
        return -(-largest_weight // shards)
    return min(largest_weight, -(-bucket // shards))


# ------------------------------------------------------------------------------ activations
def layer_activation_bytes(config: DecoderConfig, layout: ParallelDegrees, precision: str, micro_batch_size: int,
                           seq_len: int, layer: int | None = None) -> int:
    """Bytes one decoder layer saves for backward per micro-batch (per TP rank).

    ``activation_checkpointing="none"`` (what plait's blocks save; flash/memory-efficient SDPA,
    so no ``S x S`` score matrix), for Llama's block::

        2 norms      2 * B*S'*h*(4 + r) + 2 * 4*B*S'     fp32 input (the residual itself when
                                                         r = 4, else an fp32 copy), the
                                                         normalised tensor in the residual dtype,
                                                         the per-token rsqrt
        matmul in    (n_in + n_mlp) * B*S'*h*c           the norm outputs as the q/k/v and gate/up
                                                         matmuls save them: one tensor each when
                                                         c = r or T > 1 (plait's column matmul
                                                         casts once); at T = 1 under autocast
                                                         every nn.Linear casts its own copy
                                                         (n_in = 3, n_mlp = 2), else 1 and 1
        attention    B*S*c*(2q + 2k) + 4*B*n_q*S         rotated q and k, v, the output (o_proj's
                                                         input), the fp32 logsumexp
                     + B*S*c*q with padding heads        the masked output copy
        MLP          4 * B*S*i*c                         gate, up, silu(gate), silu(gate)*up

    Another block (its :class:`~plait.models.decoder.shapes.BlockShape`, GPT-NeoX's) changes these
    terms: a layer norm saves its input as it is and two fp32 numbers per token (mean and rstd),
    ``B*S'*h*r + 8*B*S'``, and with the parallel residual both norms read (and save) the same input,
    counted once; one fused q/k/v projection is one matmul input (``n_in = 1``) and its output
    ``B*S*c*(q + 2k)`` stays alive through the views of it the attention keeps (v), beside the
    rotated q and k and the output, ``B*S*c*(2q + k)``; a plain MLP saves its activation's input and
    output, ``2 * B*S*i*c`` (ReLU only its output, which the next matmul saves: ``B*S*i*c``).

    ``"selective"`` (the config's default names, Llama's ``self_attn.core`` and ``mlp.act``)
    recomputes the attention core (rotary, SDPA) and the MLP's activation in backward. The
    checkpointed modules' inputs stay alive (the q/k/v projections, gate and up) and so do their
    outputs, which the next matmul saves as its input (``o_proj``, or the padding-head mask's
    product, and ``down_proj``): attention keeps ``B*S*c*(2q + 2k)`` (a fused projection the same:
    its ``q + 2k`` output and the ``q`` output) and the gated MLP ``3*B*S*i*c`` (a plain one
    ``2*B*S*i*c``, no saving). What selective saves per layer is therefore only the logsumexp, the
    rotated q and k of a fused projection, the padding-head copy and ``silu(gate)`` (``B*S*i*c``):
    with flash / memory-efficient SDPA there is no ``S x S`` matrix to drop. Measured equal to the
    live tensors of a real checkpointed forward (tests). ``"full"`` keeps only the layer input,
    ``B*S'*h*r`` (the one layer being recomputed is added once, by :func:`estimate_memory`).

    A sparse layer of an MoE family (``layer`` given): the MLP's terms (its matmul input and the
    SwiGLU tensors) are replaced by the MoE block's, :func:`plait.plan.moe.moe_activation_bytes`
    (routing, dispatch indices, the expert rows including the fixed-slot padding under expert
    parallelism, their SwiGLU tensors, the fp32 combine); ``"selective"`` does not checkpoint
    it (its default modules are the attention core and ``mlp.act``). Under sequence parallelism
    the MoE block holds the rank's sequence shard, ``B * S'`` tokens (each TP rank routes its own;
    without it every TP rank routes all ``B * S``).
    """
    pb = precision_bytes(precision)
    sh = local_shapes(config, layout)
    block = block_of(config)
    B, S, h = micro_batch_size, seq_len, sh.hidden
    S_r = _replicated_seq(layout, seq_len)
    r, c = pb.residual, pb.compute
    if layout.activation_checkpointing == "full":
        return B * S_r * h * r
    if layout.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={layout.activation_checkpointing!r} is not valid; "
                         f"valid: {', '.join(map(repr, ACTIVATION_CHECKPOINTING))}")
    norms = _block_norm_bytes(block, B * S_r, h, r)
    n_in, n_mlp = _matmul_inputs(block, pb, sh.tp)
    moe = moe_shape(config)
    sparse = moe is not None and layer is not None and moe.is_sparse(layer)
    if sparse:
        n_mlp = 0
    matmul_in = (n_in + n_mlp) * B * S_r * h * c
    if block.latent is not None:
        attn = _latent_attention_bytes(block, sh, B * S, c, lse=layout.activation_checkpointing != "selective")
        mlp = ((3 if block.gated_mlp else 2) * B * S * sh.intermediate * c
               if layout.activation_checkpointing == "selective" else _mlp_bytes(block, B * S, sh.intermediate, c))
    elif layout.activation_checkpointing == "selective":
        attn = B * S * c * (2 * sh.q + 2 * sh.kv)
        mlp = (3 if block.gated_mlp else 2) * B * S * sh.intermediate * c
    else:
        attn = B * S * c * (2 * sh.q + 2 * sh.kv) + 4 * B * sh.q_heads * S
        if block.fused_qkv:  # the fused output (v's storage), rotated q and k, the output
            attn = B * S * c * ((sh.q + 2 * sh.kv) + (sh.q + sh.kv) + sh.q) + 4 * B * sh.q_heads * S
        if sh.head_padding:
            attn += B * S * c * sh.q
        mlp = _mlp_bytes(block, B * S, sh.intermediate, c)
    if sparse:
        assert moe is not None
        mlp = moe_activation_bytes(moe, h, B * S_r, sh.ep, compute=c, residual=r, autocast=pb.autocast)
    return norms + matmul_in + attn + mlp


def _prediction_module_bytes(block: BlockShape, tokens: int, h: int, pb: PrecisionBytes) -> int:
    """What a tail module saves besides its block (priced as DeepSeek-V3's multi-token prediction,
    the only tail there is): the embedding's norm (a block norm), the previous hidden state's norm
    (its fp32 input is the one the final norm or the previous module's output norm already saves
    when the residual is fp32), the ``2h -> h`` projection's input ``2 T h c``, the output norm and
    the head's input ``T h c``; its logits are the last stage's ``logits_saved`` once more."""
    r, c = pb.residual, pb.compute
    inp, rest = _norm_bytes(block, tokens, h, r)
    return 2 * (inp + rest) + rest + (inp if r != 4 else 0) + 2 * tokens * h * c + tokens * h * c


def _latent_attention_bytes(block: BlockShape, sh: LocalShapes, tokens: int, c: int, *, lse: bool) -> int:
    """What latent attention saves for ``tokens`` tokens (``block.latent``; the rank's ``n`` heads).

    The compressions: the query latent's norm its fp32 input, normalised tensor and rsqrt, and
    ``q_b_proj`` its output, ``T r_q (4 + 2c) + 4T``; the key/value latent's norm the same over
    ``kv_rank`` (its fp32 input is the whole ``kv_a_proj`` output, rotary key part included, when
    that is fp32) and ``kv_b_proj`` its output. The core: the rotated queries and keys,
    ``2 T n (d_nope + d_rope) c``, the values as a view of ``kv_b_proj``'s output,
    ``T n (d_nope + d_v) c``, the output ``T n d_v c`` and, unless the core is recomputed
    (``selective``), the fp32 logsumexp ``4 T n``. That is the flash / memory-efficient kernels'
    (CUDA); PyTorch's CPU kernels take the math path when the value width differs from the query's,
    which also saves the ``B n S^2`` probabilities (tests/test_deepseek_v3.py measures both)."""
    lat, n, T = block.latent, sh.q_heads, tokens
    assert lat is not None
    query = T * lat.q_rank * (4 + 2 * c) + 4 * T if lat.q_rank is not None else 0
    kv_input = lat.kv_rank + (lat.rope_dim if c == 4 else 0)
    kv = T * (4 * kv_input + 2 * c * lat.kv_rank) + 4 * T
    core = T * n * c * (2 * (lat.nope_dim + lat.rope_dim) + lat.nope_dim + 2 * lat.v_dim) + (4 * T * n if lse else 0)
    return query + kv + core


def _norm_bytes(block: BlockShape, tokens: int, h: int, r: int) -> tuple[int, int]:
    """``(input part, the rest)`` one norm saves for ``tokens`` tokens: an RMSNorm its fp32 input
    (``4``), the normalised tensor (``r``) and the rsqrt; a layer norm its input as it is (``r``) and
    the mean and rstd (fp32)."""
    if block.norm == "layer":
        return tokens * h * r, 8 * tokens
    return tokens * h * 4, tokens * h * r + 4 * tokens


def _block_norm_bytes(block: BlockShape, tokens: int, h: int, r: int) -> int:
    """The two norms of a block: with the parallel residual they read the same input, which is saved
    once when the norm keeps it as it is (a layer norm; an RMSNorm when the residual is fp32)."""
    inp, rest = _norm_bytes(block, tokens, h, r)
    shared = block.parallel_residual and (block.norm == "layer" or r == 4)
    return (1 if shared else 2) * inp + 2 * rest


def _matmul_inputs(block: BlockShape, pb: PrecisionBytes, tp: int) -> tuple[int, int]:
    """Copies of the attention's and the MLP's input that their first matmuls save: one each, except
    at ``T = 1`` under autocast, where every ``nn.Linear`` casts its own (separate q/k/v: 3; latent
    attention's two compressions: 2; a gated MLP's gate and up: 2)."""
    own_copies = pb.autocast and tp == 1
    attention = 1 if block.fused_qkv else (2 if block.latent is not None else 3)  # latent: q_a and kv_a
    return (attention if own_copies else 1), (2 if own_copies and block.gated_mlp else 1)


def _mlp_bytes(block: BlockShape, tokens: int, i: int, c: int) -> int:
    """What a dense MLP saves without checkpointing: gate, up, silu(gate) and the product (SwiGLU);
    the activation's input and output (plain MLP; ReLU keeps only its output)."""
    if block.gated_mlp:
        return 4 * tokens * i * c
    return (1 if block.activation == "relu" else 2) * tokens * i * c


def _replicated_seq(layout: ParallelDegrees, seq_len: int) -> int:
    """Sequence length of the tensors outside the TP-sharded blocks (``S / T`` under SP)."""
    if layout.sequence_parallel and layout.tp > 1:
        return -(-seq_len // layout.tp)
    return seq_len


@dataclass(frozen=True)
class ChunkCost:
    """What one chunk costs during the activation phase (bytes; see :func:`chunk_cost`)."""

    activations: int      # saved per in-flight micro-batch (layers, rotary tables, final norm)
    weight_copies: int    # autocast's bf16 weight copies per in-flight micro-batch
    logits_saved: int     # last stage: what the loss saves (logits or log-softmax) per in-flight micro-batch
    gradients: int        # the chunk's part of the flat gradient buffer (alive the whole step)
    forward_transient: int    # while a forward runs (the loss working set on the last stage)
    backward_transient: int   # at the start of a backward (loss working set, largest new gradient)
    backward_end_transient: int  # at the end of a backward (the embedding's new gradient)


def chunk_cost(config: DecoderConfig, layout: ParallelDegrees, precision: str, chunk: Chunk, micro_batch_size: int,
               seq_len: int) -> ChunkCost:
    """Activation-phase costs of one chunk (module doc; ``N = B * S`` tokens, ``V'`` local vocab).

    * activations: ``len(layers) * layer_activation_bytes`` + the rotary ``cos``/``sin`` tables
      (``2 * S * rotary_dim * r``, ``rotary_dim = head_dim`` but under partial rotary); last stage:
      the final norm as a layer's norm saves it (RMSNorm ``B*S'*h*(4 + r) + 4*B*S'``, layer norm
      ``B*S'*h*r + 8*B*S'``: its fp32 mean and rstd, as CUDA keeps them; the CPU kernel keeps a bf16
      norm's in bf16, 4 bytes per token less) and the output head's input (``B*S'*h*c``).
    * weight_copies (autocast only): ``2 * matmul weights`` of the layers, their biases aside (none
      under full checkpointing: the recomputation casts again), and of the output head on the last
      stage.
    * logits_saved (last stage): TP = 1 (``F.cross_entropy`` on ``logits.float()``): the fp32
      log-softmax, ``4 N V'``. The chunked vocab-parallel loss (TP > 1, or cp > 1 at any TP): the
      logits it receives, ``l N V'`` with ``l = c`` under TP and ``l = 4`` under cp (the output
      module's fp32 copy), plus the row maximum and the sum of exponentials, ``8 N``.
    * forward_transient (last stage): the loss's working set besides what it saves. Vocab-parallel:
      one fp32 chunk of rows, ``4 * min(rows, N) * V'`` (``rows`` =
      :func:`~plait.tensor_parallel.cross_entropy.default_chunk_rows`, about 1 MiB), plus under cp
      with ``c != 4`` the head's output beside its fp32 copy, ``c N V'``. TP = 1: the logits and
      their fp32 copy, ``(c + 4) N V'`` when ``c != 4`` else ``4 N V'``.
    * backward_transient: the largest of (last stage) the loss backward's working set (TP = 1:
      NLL and log-softmax input gradients, ``8 N V'``; vocab-parallel: the logits' gradient beside
      the saved logits, ``l N V'``, plus the fp32 chunk when ``l != 4``), (last stage) the output
      head's new weight gradient plus the logits gradient, less the saved logits / log-softmax
      already released (``V' h (p + c_a) + (c - l) N V'``, ``l = 4`` at TP = 1; ``c_a = c`` under
      autocast: the bf16 product before its cast to the parameter dtype), and the largest decoder
      weight's new gradient (``numel * (p + c_a)``). New gradients are autograd's, in the parameter
      dtype ``p``; the post-accumulate hook adds each into the flat buffer and frees it.
    * backward_end_transient (first stage): the embedding's dense gradient ``V' h p``, created
      after the stage's activations are freed (on top of the gradient buffer, every backward).
    """
    pb = precision_bytes(precision)
    sh = local_shapes(config, layout)
    block = block_of(config)
    B, S, h = micro_batch_size, seq_len, sh.hidden
    S_r = _replicated_seq(layout, S)
    N = B * S
    c, r, g, p = pb.compute, pb.residual, pb.grad, pb.param
    one_norm = sum(_norm_bytes(block, B * S_r, h, r))
    c_a = c if pb.autocast else 0
    moe = moe_shape(config)
    if moe is None:
        act = len(chunk.layers) * layer_activation_bytes(config, layout, precision, B, S)
    else:
        act = sum(count * layer_activation_bytes(config, layout, precision, B, S, layer)
                  for layer, count in layer_kinds(moe, chunk.layers))
    act += 2 * S * block.rotary_dim * r
    copies = 0
    if moe is not None:
        copies = _moe_chunk_copies(config, moe, sh, pb, layout, chunk)
    elif pb.autocast and layout.activation_checkpointing != "full":
        copies = 2 * len(chunk.layers) * layer_weight_copy_count(config, sh)
    logits = fwd = 0
    bwd = max(*qkv_weight_sizes(block, sh), sh.hidden * sh.intermediate) * (p + c_a) if chunk.layers else 0
    if moe is not None and any(moe.is_sparse(layer) for layer in chunk.layers):
        # the grouped matmul's gradient of one stacked projection [E/ep, h, w] (compute dtype), then
        # its cast to the parameter dtype before it is split into the experts' gradients
        bwd = max(bwd, local_experts(moe, sh.ep) * h * moe.width * (c + (p if p != c else 0))
                  # sequence parallelism: the hook's copy of one expert projection's gradient to sum over TP
                  + (h * moe.width * p if layout.sequence_parallel and sh.tp > 1 else 0))
    if chunk.last:
        act += one_norm + B * S_r * h * c
        if pb.autocast:
            copies += 2 * sh.vocab * h
        if sh.tp > 1 or layout.cp > 1:  # cp's output module runs the vocab-parallel loss at any TP
            # the chunked loss saves the logits it is given (cp's output module hands it an fp32
            # copy, TP's the head's output in the compute dtype) and two fp32 numbers per token
            loss_in = 4 if layout.cp > 1 else c
            logits = loss_in * N * sh.vocab + 8 * N
            work = 4 * min(default_chunk_rows(sh.vocab), N) * sh.vocab  # one fp32 chunk of rows
            fwd = (c if loss_in != c else 0) * N * sh.vocab + work  # cp: the head's output beside its copy
            # the logits' gradient beside the saved logits, and a work chunk unless it is computed
            # in place (fp32); a cp cast of that gradient to the compute dtype comes after the
            # saved copy is released and is smaller
            loss_bwd = loss_in * N * sh.vocab + (work if loss_in != 4 else 0)
        else:
            logits = 4 * N * sh.vocab
            loss_in = 4
            fwd = ((c + 4) if c != 4 else 4) * N * sh.vocab
            loss_bwd = 8 * N * sh.vocab
        # the head's new weight gradient and the logits gradient; this micro-batch's saved logits /
        # log-softmax (counted in logits_saved) are released by then, or reused as the gradient in place
        head = sh.vocab * h * (p + c_a) + (c - loss_in) * N * sh.vocab
        bwd = max(bwd, loss_bwd, head)
        tail = config.tail_layer_ids()
        if tail:
            act += sum(layer_activation_bytes(config, layout, precision, B, S, layer if moe else None)
                       for layer in tail)
            act += len(tail) * _prediction_module_bytes(block, B * S_r, h, pb)
            logits += len(tail) * logits
            if moe is not None:
                copies += _moe_chunk_copies(config, moe, sh, pb, layout, Chunk(chunk.stage, tuple(tail), False, False))
            elif pb.autocast and layout.activation_checkpointing != "full":
                copies += 2 * len(tail) * layer_weight_copy_count(config, sh)
            if pb.autocast:  # each module's 2h -> h projection (the head's copy is autocast's cached one)
                copies += len(tail) * 2 * 2 * h * h
    if layout.cp > 1 and chunk.layers:  # the ring kernel's piece scores, first in the last layer's attention backward
        released = 0  # what this micro-batch has freed by then: saved logits, final norm, head input, last MLP half
        if chunk.last:
            released += logits + one_norm + B * S_r * h * c
        if layout.activation_checkpointing == "none":  # the MLP half: its norm, matmul input and tensors
            n_mlp = _matmul_inputs(block, pb, sh.tp)[1]
            mlp_norm = _block_norm_bytes(block, B * S_r, h, r) - one_norm  # shared input: its stats only
            released += mlp_norm + n_mlp * B * S_r * h * c + _mlp_bytes(block, B * S, sh.intermediate, c)
        bwd = max(bwd, attention_workspace_bytes(B, S, sh.q_heads) - released)
    end = sh.vocab * h * p if chunk.first else 0
    grads = chunk_parameter_count(config, sh, chunk) * g
    return ChunkCost(act, copies, logits, grads, fwd, bwd, end)


def _moe_chunk_copies(config: DecoderConfig, moe: MoEShape, sh: LocalShapes, pb: PrecisionBytes,
                      layout: ParallelDegrees, chunk: Chunk) -> int:
    """Weight copies an MoE family's chunk keeps per in-flight micro-batch: autocast's bf16 copies
    of the attention (and dense MLP) weights, and each sparse layer's stacked expert weights and
    upcast router (:func:`plait.plan.moe.moe_weight_copies`); none under full checkpointing."""
    if layout.activation_checkpointing == "full":
        return 0
    total = 0
    for layer, count in layer_kinds(moe, chunk.layers):
        one = 0
        if moe.is_sparse(layer):
            dense = layer_matmul_parameter_count(config, sh, layer) - shared_parameter_count(moe, sh.hidden) \
                - expert_parameter_count(moe, sh.hidden, sh.ep)
            one += moe_weight_copies(moe, sh.hidden, sh.ep, compute=pb.compute, param=pb.param, autocast=pb.autocast)
        else:
            dense = layer_matmul_parameter_count(config, sh, layer)
        one += 2 * dense if pb.autocast else 0
        total += count * one
    return total


@dataclass(frozen=True)
class SchedulePeak:
    """The activation-phase peak of one rank, by component (bytes)."""

    in_flight: dict[int, int]   # chunk index on the rank -> in-flight micro-batches at the peak
    gradients: int              # the gradient buffer (always whole)
    activations: int
    weight_copies: int
    logits: int
    p2p: int
    workspace: int
    max_in_flight: int = 0      # most (micro-batch, chunk) pairs in flight at any point of the step

    @property
    def total(self) -> int:
        return self.gradients + self.activations + self.weight_copies + self.logits + self.p2p + self.workspace


@functools.lru_cache(maxsize=4096)
def _compute_order(schedule: str, pp_rank: int, pp: int, microbatches: int, vpp: int) -> tuple:
    """``(is_forward, microbatch, chunk)`` in a rank's compute order, cached: the layout search asks
    for the same schedules many times."""
    if pp == 1:
        return tuple((fwd, mb, 0) for mb in range(microbatches) for fwd in (True, False))
    # a zero-bubble schedule's W tasks free nothing the walk counts (their working sets, the deferred
    # linear layers' inputs and output gradients, are not priced): only forwards and backwards
    return tuple((isinstance(t, Forward), t.microbatch, t.chunk)
                 for t in compute_order(schedule, pp_rank, pp, microbatches, vpp) if not isinstance(t, WeightGrad))


def schedule_peak(layout: ParallelDegrees, microbatches: int, pp_rank: int, costs: list[ChunkCost],
                  chunks: list[Chunk], *, act_bytes: int, extra_layer: int = 0) -> SchedulePeak:
    """Walk the rank's compute order and return the largest activation-phase footprint.

    The order is the schedule's (:func:`plait.pipeline.schedules.compute_order`; without pipeline
    parallelism ``F0 B0 F1 B1 ...``, one micro-batch in flight). Three kinds of points:

    * after a Forward: the in-flight micro-batches' saved bytes (this one included) and the
      chunk's ``forward_transient``;
    * at the start of a Backward: the same plus ``backward_transient``, one received output
      gradient (``act_bytes``) on a non-last chunk, and under full checkpointing the recomputed
      layer (``extra_layer``);
    * at the end of a Backward on the first stage: the remaining in-flight bytes plus the
      embedding's ``backward_end_transient``.

    Everywhere: the whole flat gradient buffer (all chunks' ``gradients``: it lives through the
    step), and the p2p buffers plait's runtime keeps: ``act_bytes`` per micro-batch in flight on a
    non-last chunk (the sent output, released when its gradient comes back and its backward has
    run) and per Backward done on a non-first chunk (the sent input gradient, kept until the
    step's end).
    """
    order = _compute_order(layout.schedule if layout.pp > 1 else "", pp_rank, layout.pp, microbatches, layout.vpp)
    in_flight = {i: 0 for i in range(len(chunks))}
    gradients = sum(c.gradients for c in costs)
    piped = layout.pp > 1
    sent_grads = 0
    most = 0
    best: SchedulePeak | None = None

    def point(transient: int, p2p_extra: int = 0, act_extra: int = 0) -> None:
        nonlocal best
        sent_acts = sum(n for c, n in in_flight.items() if piped and not chunks[c].last)
        p = SchedulePeak(
            in_flight=dict(in_flight),
            gradients=gradients,
            activations=sum(n * costs[c].activations for c, n in in_flight.items()) + act_extra,
            weight_copies=sum(n * costs[c].weight_copies for c, n in in_flight.items()),
            logits=sum(n * costs[c].logits_saved for c, n in in_flight.items()),
            p2p=(sent_acts + sent_grads) * act_bytes + p2p_extra,
            workspace=transient,
        )
        if best is None or p.total > best.total:
            best = p

    for is_fwd, _mb, c in order:
        ch, cost = chunks[c], costs[c]
        if is_fwd:
            in_flight[c] += 1
            most = max(most, sum(in_flight.values()))
            point(cost.forward_transient)
            continue
        point(cost.backward_transient, 0 if (ch.last or not piped) else act_bytes, extra_layer)
        in_flight[c] -= 1
        if ch.first:
            point(cost.backward_end_transient)
        elif piped:
            sent_grads += 1
    assert best is not None
    return dataclasses.replace(best, max_in_flight=most)


# ------------------------------------------------------------------------------ breakdown
@dataclass
class MemoryBreakdown:
    """Bytes per rank of one layout (one pipeline rank, or the worst one); see the module doc.

    ``gradients`` is the rank's flat gradient buffer; ``gradients_at_peak`` the part of it alive at
    the activation-phase peak, which is all of it since the buffer lives through the step (kept as
    a field so reports keep their columns). ``gradient_shard`` is ZeRO-1's reduce-scatter target.
    ``workspace`` holds the transient at the peak (the loss's working set on the last stage, or a
    new gradient before it is added into the buffer).
    """

    layout: ParallelDegrees
    precision: str
    pp_rank: int
    parameter_count: int
    parameters: int
    gradients: int
    optimizer: int
    master_weights: int
    activations: int
    weight_copies: int
    logits: int
    comm_buffers: int
    workspace: int
    step_buffers: int
    gradients_at_peak: int = 0
    gradient_shard: int = 0
    #: global stage -> in-flight micro-batches at the peak (not necessarily the most ever in flight:
    #: a later point with gradients allocated can be the larger one)
    in_flight: dict[int, int] = field(default_factory=dict)
    #: most (micro-batch, chunk) pairs in flight at any point of the step (the simulator's
    #: ``peak_in_flight``)
    max_in_flight: int = 0
    #: MoE: the routed-expert parameters among ``parameter_count`` (``experts / ep`` of each sparse
    #: layer; reduced and ZeRO-1-sharded over the ``dp / ep`` expert-data-parallel ranks)
    expert_parameter_count: int = 0
    #: optimizer offload: the bytes in host memory instead (fp32 moments, master and the host copy
    #: of the owned gradients), not part of ``total``, which is the device's
    host_bytes: int = 0

    FIELDS = ("parameters", "gradients", "gradient_shard", "optimizer", "master_weights", "activations",
              "weight_copies", "logits", "comm_buffers", "workspace", "step_buffers")

    @property
    def model_states(self) -> int:
        """Parameters, both gradient buffers, optimizer state and master weights: alive all step."""
        return self.parameters + self.gradients + self.gradient_shard + self.optimizer + self.master_weights

    @property
    def activation_phase(self) -> int:
        """Bytes above the other persistent states (parameters, optimizer, master, gradient shard)
        at the activation peak, the gradient buffer included."""
        return (self.gradients_at_peak + self.activations + self.weight_copies + self.logits + self.comm_buffers
                + self.workspace)

    @property
    def step_phase(self) -> int:
        """Bytes above the persistent states while gradients are reduced, clipped and applied."""
        return self.gradients + self.step_buffers

    @property
    def total(self) -> int:
        return (self.parameters + self.optimizer + self.master_weights + self.gradient_shard
                + max(self.activation_phase, self.step_phase))

    def as_dict(self) -> dict:
        d = {"layout": self.layout.as_dict(), "precision": self.precision, "pp_rank": self.pp_rank,
             "parameter_count": self.parameter_count, "in_flight": dict(self.in_flight),
             "max_in_flight": self.max_in_flight, "expert_parameter_count": self.expert_parameter_count,
             "host_bytes": int(self.host_bytes)}
        d.update({k: int(getattr(self, k)) for k in self.FIELDS})
        d["gradients_at_peak"] = int(self.gradients_at_peak)
        d["total"] = int(self.total)
        return d

    @staticmethod
    def table_header(unit: str = "MiB") -> str:
        cols = ["layout", "precision", "pp rank", *MemoryBreakdown.FIELDS, f"total ({unit})"]
        return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)

    def table_row(self, unit: str = "MiB") -> str:
        """One markdown table row (sizes in ``unit``: "MiB", "GiB" or "B"), matching :meth:`table_header`."""
        div = {"B": 1, "MiB": MiB, "GiB": 1024**3}[unit]
        fmt = (lambda v: f"{v / div:.1f}") if unit != "B" else str
        cells = [self.layout.short(), self.precision, str(self.pp_rank)]
        values = [getattr(self, k) for k in self.FIELDS]
        cells += [fmt(v) for v in values] + [fmt(self.total)]
        return "| " + " | ".join(cells) + " |"


def estimate_memory(config: DecoderConfig, layout: ParallelDegrees, *, precision: str = "fp32", micro_batch_size: int,
                    seq_len: int, microbatches: int, stage: int | None = None,
                    stage_layers: list[list[int]] | None = None,
                    adapters: AdapterPlan | None = None) -> MemoryBreakdown:
    """Peak bytes on one rank of ``layout`` for a training step (see the module doc for every term).

    ``stage``: the pipeline rank (``0 .. pp - 1``) to price; ``None`` prices every pipeline rank
    and returns the one with the largest ``total``. ``stage_layers`` overrides the pipeline split
    (default: :func:`plait.plan.pipeline_split.plan_partition`, balanced by FLOPs). ``adapters``:
    a LoRA run, only the adapters trained and the base stored as it says (:mod:`plait.plan.adapters`).
    """
    pb = precision_bytes(precision)
    for name, v in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len), ("microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if layout.pp * layout.vpp > 1 and stage_layers is None:
        stage_layers = default_stage_layers(config, layout.pp * layout.vpp, seq_len)
    if seq_len % (2 * layout.cp):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp={2 * layout.cp}")
    local = seq_len // layout.cp  # context parallelism: the rank's share of every sequence
    if stage is None:
        ranks = [_estimate_rank(config, layout, pb, micro_batch_size, local, microbatches, r, stage_layers, adapters)
                 for r in range(layout.pp)]
        return max(ranks, key=lambda b: (b.total, -b.pp_rank))
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < layout.pp:
        raise ValueError(f"stage={stage!r} must be a pipeline rank in 0..{layout.pp - 1}")
    return _estimate_rank(config, layout, pb, micro_batch_size, local, microbatches, stage, stage_layers, adapters)


def _estimate_rank(config: DecoderConfig, layout: ParallelDegrees, pb: PrecisionBytes, B: int, S: int, m: int,
                   pp_rank: int, stage_layers: list[list[int]] | None,
                   adapters: AdapterPlan | None = None) -> MemoryBreakdown:
    sh = local_shapes(config, layout)
    chunks = rank_chunks(config, layout, S, pp_rank, stage_layers=stage_layers)
    counts = [chunk_parameter_count(config, sh, ch) for ch in chunks]
    P = sum(counts)
    dp = layout.dp * layout.cp  # the ranks that average gradients (ZeRO-1 shards over them)
    level = layout.zero if dp > 1 else 0  # ZeRO at dp = 1 warns and trains unsharded
    zero = level >= 1
    owned = -(-P // dp) if zero else P
    experts = sum(chunk_expert_parameter_count(config, sh, ch) for ch in chunks)
    if zero and layout.ep > 1:  # expert buckets are sharded over the expert-data-parallel group
        owned = -(-(P - experts) // dp) + -(-experts // (dp // layout.ep))

    costs = [chunk_cost(config, layout, pb.name, ch, B, S) for ch in chunks]
    act_bytes = B * _replicated_seq(layout, S) * sh.hidden * pb.residual
    extra_layer = 0
    if layout.activation_checkpointing == "full":
        # the layer being recomputed holds its full activations (and its weight copies under autocast)
        if moe_shape(config) is None:
            extra_layer = layer_activation_bytes(config, dataclasses.replace(layout, activation_checkpointing="none"),
                                                 pb.name, B, S)
            if pb.autocast:
                extra_layer += 2 * layer_weight_copy_count(config, sh)
        else:
            extra_layer = _moe_recomputed_layer(config, layout, pb, B, S, chunks)
    peak = schedule_peak(layout, m, pp_rank, costs, chunks, act_bytes=act_bytes, extra_layer=extra_layer)
    tp_gather = B * S * sh.hidden * pb.compute if (layout.sequence_parallel and layout.tp > 1) else 0
    ring = ring_buffer_bytes(B, S, sh.kv) if layout.cp > 1 else 0  # S is the local sequence here
    moe = moe_shape(config)
    # the exchange buffers hold the rank's routed tokens: its sequence shard under sequence parallelism
    exchange = moe_comm_buffer_bytes(moe, sh.hidden, B * _replicated_seq(layout, S), layout.ep, pb.residual) \
        if moe is not None and any(moe.is_sparse(layer) for ch in chunks for layer in ch.layers) else 0
    # step phase, one transient at a time: the norm's fp32 copies of bf16 gradients, the bf16
    # optimizer's fp32 working copies of its largest segment, ZeRO-1's all-gather staging
    norm_copies = 4 * owned if pb.grad < 4 else 0
    # (the routed experts' buckets are sharded over the dp / ep expert-data-parallel ranks)
    largest_dense, largest_expert = _largest_weights(config, sh, chunks)
    lowp_update = 8 * 4 * max(_largest_segment(largest_dense, dp if zero else 1, pb.grad),
                              _largest_segment(largest_expert, dp // layout.ep if zero else 1, pb.grad)) \
        if pb.optimizer_state < 4 else 0
    staging = owned * pb.param if level in (1, 2) else 0  # ZeRO-3 updates its chunks in place
    step_buffers = max(norm_copies, lowp_update, staging)
    parameters, gradients, gradients_at_peak = P * pb.param, P * pb.grad, peak.gradients
    if level >= 2:
        # no whole gradient buffer: a few buckets' full gradients between their first gradient and
        # the end of their reduce-scatter (two reductions in flight and one filling, see
        # data_parallel/sharded_grads.py); ZeRO-3 buckets are whole units
        block, root_part = _unit_sizes(config, sh, chunks, P)
        bucket = max(block, root_part) if level == 3 else max(ZERO2_BUCKET_BYTES // pb.grad, largest_dense)
        gradients = gradients_at_peak = min(P, 3 * bucket) * pb.grad
    if level == 3:
        # the owned chunks, the stage roots (embedding, norm, head: gathered through the step) and
        # two blocks gathered at a time (the one computing and the prefetched next)
        root = P - sum(_layer_count(config, sh, layer) for ch in chunks for layer in ch.layers)
        parameters = (owned + root + min(P - root, 2 * block)) * pb.param
    optimizer, master = 2 * owned * pb.optimizer_state, (owned if zero else P) * pb.master
    gradient_shard, count = owned * pb.grad if zero else 0, P
    lora = None
    if adapters is not None:
        layers = sum(len(ch.layers) for ch in chunks)
        lora = adapter_states(block_of(config) if moe_shape(config) is None else None, sh, adapters,
                              layers, P, pb.param, shards=dp if level == 3 else 1)
    if lora is not None:  # only the adapters train: gradients, moments and master copies are theirs alone
        trained, parameters = lora
        owned = -(-trained // dp) if zero else trained
        gradients = gradients_at_peak = trained * pb.grad
        gradient_shard = owned * pb.grad if zero else 0
        optimizer, master, count = 2 * owned * pb.optimizer_state, (owned if zero else trained) * pb.master, \
            P + trained
        step_buffers = max(4 * owned if pb.grad < 4 else 0, owned * pb.param if level in (1, 2) else 0)
    host = 0
    if layout.offload:  # fp32 moments, master and owned-gradient copy in host memory (see the module doc)
        optimizer, master, host = 0, 0, 16 * owned
    return MemoryBreakdown(
        layout=layout, precision=pb.name, pp_rank=pp_rank, parameter_count=count,
        parameters=parameters, gradients=gradients, gradient_shard=gradient_shard,
        optimizer=optimizer, master_weights=master, host_bytes=host,
        activations=peak.activations, weight_copies=peak.weight_copies, logits=peak.logits,
        comm_buffers=peak.p2p + tp_gather + ring + exchange, workspace=peak.workspace, step_buffers=step_buffers,
        gradients_at_peak=gradients_at_peak, in_flight={chunks[c].stage: n for c, n in peak.in_flight.items()},
        max_in_flight=peak.max_in_flight, expert_parameter_count=experts,
    )


#: ZeRO-2's bucket cap as the planner prices it (``parallel.bucket_mb``'s default, 25 MB)
ZERO2_BUCKET_BYTES = 25 * 2**20


def _layer_count(config: DecoderConfig, sh: LocalShapes, layer: int) -> int:
    return chunk_parameter_count(config, sh, Chunk(-1, (layer,), False, False))


def _unit_sizes(config: DecoderConfig, sh: LocalShapes, chunks: list[Chunk], total: int) -> tuple[int, int]:
    """ZeRO-3's units on a rank: (elements of its largest decoder block, of the largest bucket of a
    stage root: the embedding or the head)."""
    block = max((_layer_count(config, sh, layer) for ch in chunks for layer in ch.layers), default=0)
    root_part = sh.vocab * sh.hidden if any(ch.first or ch.last for ch in chunks) else 0
    return block, min(total, root_part)


def _moe_recomputed_layer(config: DecoderConfig, layout: ParallelDegrees, pb: PrecisionBytes, B: int, S: int,
                          chunks: list[Chunk]) -> int:
    """Full checkpointing, MoE family: the largest of the rank's layers while it is recomputed
    (its activations without checkpointing and its weight copies)."""
    none = dataclasses.replace(layout, activation_checkpointing="none")
    sh = local_shapes(config, layout)
    best = 0
    moe = moe_shape(config)
    assert moe is not None
    layers = [layer for ch in chunks for layer in ch.layers]
    for layer, _ in layer_kinds(moe, layers):
        one = Chunk(-1, (layer,), False, False)
        best = max(best, layer_activation_bytes(config, none, pb.name, B, S, layer)
                   + _moe_chunk_copies(config, moe, sh, pb, none, one))
    return best


__all__ = ["Chunk", "ChunkCost", "LocalShapes", "MemoryBreakdown", "PRECISIONS", "PrecisionBytes", "SchedulePeak",
           "chunk_cost", "chunk_expert_parameter_count", "chunk_parameter_count", "default_stage_layers",
           "estimate_memory", "ffn_parameter_count", "layer_activation_bytes", "layer_expert_parameter_count",
           "layer_matmul_parameter_count", "layer_parameter_count", "layer_weight_copy_count", "local_shapes",
           "precision_bytes", "rank_chunks", "rank_parameter_count", "schedule_peak"]
