"""The planner's Mixture-of-Experts terms (plait.plan.moe, plait.plan.memory, plait.plan.timing,
plait.plan.search) as data.

Parameter counts are compared with the model the builder makes for a rank (meta device, experts
split over ``ep``); model states with the buffers a real ``DistributedOptimizer`` allocates with
expert buckets; saved activations with what autograd saves in one forward of a tiny Mixtral
(saved-tensor hooks), expert parallelism included: the all-to-all is replaced by a copy, so one
process runs the real dispatcher with its real buffer shapes; sequence parallelism with the MoE
layer run on one rank's sequence shard (what each TP rank runs); the all-to-all volume with the
bytes that dispatcher hands to the exchange in a forward and backward. The search is checked on
Mixtral-8x7B's shape, and a dense model's plan against the numbers of the planner before MoE.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
import torch

from plait.activation_checkpointing import apply_activation_checkpointing
from plait.comm.primitives import GroupInfo
from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
from plait.devices import get_device
from plait.materialize import build_model, build_stages
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.mixtral import MixtralConfig
from plait.models.qwen3.config import Qwen3Config
from plait.models.qwen3_moe.config import Qwen3MoeConfig
from plait.moe.expert_parallel import apply_expert_parallel, expert_parameter_names
from plait.nn.moe import MoELayer, SoftmaxTopKRouter
from plait.plan.degrees import ParallelDegrees
from plait.plan.memory import (
    chunk_cost,
    chunk_expert_parameter_count,
    estimate_memory,
    layer_activation_bytes,
    local_shapes,
    rank_chunks,
    rank_parameter_count,
)
from plait.plan.moe import (
    MoEShape,
    all_to_all_bytes,
    expert_parameter_count,
    moe_activation_bytes,
    moe_parameter_count,
    moe_shape,
    moe_weight_copies,
    sequence_parallel_tp_bytes,
    shared_parameter_count,
)
from plait.plan.pipeline_split import plan_partition
from plait.plan.search import SearchOptions, enumerate_layouts, rank_layouts
from plait.plan.timing import estimate_step_time, rank_flops
from plait.precision import policy_for
from test_plan_memory import _saved_bytes as saved_bytes

RECIPES = Path(__file__).resolve().parent.parent / "src" / "plait" / "recipes"


def mixtral(**kw) -> MixtralConfig:
    base = dict(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    base.update(kw)
    return MixtralConfig(**base)


def qwen3_moe(**kw) -> Qwen3MoeConfig:
    base = dict(vocab_size=1001, hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                mlp_only_layers=[0])
    base.update(kw)
    return Qwen3MoeConfig(**base)


def recipe_config(name: str):
    from plait.commands.plan import load_plan_inputs

    return load_plan_inputs(str(RECIPES / name), [])[1]


# ------------------------------------------------------------------------------ parameters
def _built(config, layout: ParallelDegrees, rank: int, seq_len: int = 64) -> tuple[int, int]:
    """(parameters, routed-expert parameters) the builder gives ``rank`` (meta device)."""
    mesh = ParallelMesh(layout.world, rank, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep,
                        create_groups=False)
    if layout.pp == 1:
        modules = [build_model(config, mesh, device="meta", init=False)]
    else:
        split = plan_partition(config, layout.pp, seq_len).stage_layers()
        modules = build_stages(config, mesh, split, device="meta", init=False)
    apply_expert_parallel(modules, mesh.info("ep"))  # idempotent: the builder may have applied it already
    params = [p for m in modules for p in m.parameters()]
    experts = sum(p.numel() for m in modules for n, p in m.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in params), experts


SLOW = pytest.mark.slow


@pytest.mark.parametrize("make,degrees", [
    (mixtral, dict(tp=2, dp=2, ep=2)), (qwen3_moe, dict(pp=2, dp=2, ep=2)), (qwen3_moe, dict(tp=2, dp=4, ep=4)),
    *(pytest.param(make, degrees, marks=SLOW) for make in (mixtral, qwen3_moe)
      for degrees in (dict(), dict(tp=2), dict(dp=2, ep=2), dict(dp=4, ep=4), dict(pp=2, dp=2, ep=2))),
])
def test_parameters_equal_the_built_rank(make, degrees):
    """Attention split over TP, experts whole on every TP rank and split over ep, the router whole,
    a Qwen3-MoE dense layer's MLP split over TP: the count equals the rank's built model."""
    config = make()
    layout = ParallelDegrees(**degrees)
    rank = layout.world - 1
    built, experts = _built(config, layout, rank)
    mesh = ParallelMesh(layout.world, rank, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep,
                        create_groups=False)
    assert rank_parameter_count(config, layout, 64, mesh.pp_rank) == built
    sh = local_shapes(config, layout)
    assert sum(chunk_expert_parameter_count(config, sh, ch) for ch in rank_chunks(config, layout, 64, mesh.pp_rank)) \
        == experts > 0


def test_expert_memory_falls_as_one_over_ep_and_dense_does_not():
    config = recipe_config("mixtral-8x7b.yaml")
    kw = dict(precision="bf16-mixed", micro_batch_size=1, seq_len=4096, microbatches=16)
    est = {ep: estimate_memory(config, ParallelDegrees(pp=4, dp=16, ep=ep, activation_checkpointing="full"), **kw)
           for ep in (1, 2, 4, 8)}
    per_layer_expert = 3 * 4096 * 14336
    for ep, m in est.items():
        assert m.expert_parameter_count == 8 * 8 // ep * per_layer_expert  # 8 layers per stage, 8/ep experts each
        assert m.parameter_count - m.expert_parameter_count == est[1].parameter_count - est[1].expert_parameter_count
        assert m.parameters == 2 * m.parameter_count and m.gradients == 4 * m.parameter_count
    assert est[8].expert_parameter_count * 8 == est[1].expert_parameter_count


def test_zero1_shards_expert_state_over_dp_over_ep():
    """Expert buckets are sharded over the dp/ep expert-data-parallel ranks, the rest over dp."""
    config = recipe_config("mixtral-8x7b.yaml")
    kw = dict(precision="bf16-mixed", micro_batch_size=1, seq_len=4096, microbatches=16)
    for ep in (1, 2, 8):
        layout = ParallelDegrees(pp=4, dp=16, ep=ep, zero=1, activation_checkpointing="full")
        m = estimate_memory(config, layout, **kw)
        dense, experts = m.parameter_count - m.expert_parameter_count, m.expert_parameter_count
        owned = -(-m.parameter_count // 16) if ep == 1 else -(-dense // 16) + -(-experts // (16 // ep))
        assert m.optimizer == 2 * 4 * owned and m.master_weights == 4 * owned and m.gradient_shard == 4 * owned


@pytest.mark.parametrize("dp,ep", [(4, 2), (8, 4), (4, 4)])
def test_bf16_optimizer_working_set_shards_expert_weights_over_dp_over_ep(dp, ep):
    """bf16-pure with ZeRO-1: LowPrecisionAdamW's fp32 working copies (8 per element) cover the
    largest owned segment. An expert projection (Mixtral-8x7B's 4096 x 14336, larger than a bucket)
    lies in an expert bucket, split over the dp / ep expert-data-parallel ranks, not dp: whole at
    ep = dp (one replica per expert). One layer and a small vocabulary keep that term the largest
    step-phase transient (above the norm's fp32 gradient copies)."""
    config = mixtral(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                     num_key_value_heads=8)
    m = estimate_memory(config, ParallelDegrees(dp=dp, ep=ep, zero=1), precision="bf16-pure", micro_batch_size=1,
                        seq_len=256, microbatches=1)
    assert m.step_buffers == 8 * 4 * -(-4096 * 14336 // (dp // ep))


@pytest.mark.parametrize("precision,dp,ep", [("bf16-mixed", 4, 2), pytest.param("fp32", 4, 2, marks=SLOW),
                                             pytest.param("bf16-mixed", 2, 2, marks=SLOW),
                                             pytest.param("fp32", 2, 2, marks=SLOW)])
def test_model_states_equal_the_optimizer_buffers_with_expert_buckets(precision, dp, ep):
    """parameters / gradients / gradient shard / master / optimizer bytes of an expert-parallel rank
    with ZeRO-1 equal a real DistributedOptimizer's, up to bucket padding."""
    config = mixtral()
    layout = ParallelDegrees(dp=dp, ep=ep, zero=1)
    est = estimate_memory(config, layout, precision=precision, micro_batch_size=1, seq_len=32, microbatches=1)
    model = build_model(config, single_process_mesh(), seed=0)
    apply_expert_parallel([model], GroupInfo(None, ep - 1, ep))
    hyper = OptimizerHyper(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    opt = DistributedOptimizer([model], policy_for(precision), hyper, dp=GroupInfo(None, dp - 1, dp),
                               tp=GroupInfo.single(), zero=True, bucket_mb=0.05, ep=GroupInfo(None, ep - 1, ep),
                               expert_dp=GroupInfo(None, 0, dp // ep), expert_names=expert_parameter_names([model]))
    opt.inner.step()
    assert any(b.expert for b in opt.bucket_plan.buckets)

    def nbytes(t):
        return t.numel() * t.element_size()

    pad = (dp - 1) * len(opt.bucket_plan.buckets)
    report = opt.memory_report()
    got = {"parameters": nbytes(opt.param_data), "gradients": nbytes(opt.grads.data),
           "gradient_shard": nbytes(opt.grads.shard_data), "master_weights": report["master_bytes"],
           "optimizer": report["optimizer_state_bytes"]}
    for name, value in got.items():
        assert abs(value - getattr(est, name)) <= 8 * pad, (name, value, getattr(est, name))
    # the negative control: sharding the experts' states over all dp ranks would price less
    assert got["optimizer"] > 2 * 4 * -(-est.parameter_count // dp) + 8 * pad


# ------------------------------------------------------------------------------ activations
def _copy_exchange():
    """The all-to-all replaced by a copy: one process runs the expert-parallel dispatcher with
    its real buffers (every peer's slot is this rank's own rows)."""
    return mock.patch("plait.moe.all_to_all.exchange", lambda x, group: x.clone()), \
        mock.patch("plait.moe.expert_parallel.exchange", lambda x, group: x.clone())


def _training_moe(model) -> None:
    for m in model.modules():
        if isinstance(m, MoELayer):
            m.aux_loss_scale, m.z_loss_scale = 0.01, 0.001


def _saved_bytes(model, ids, precision: str) -> int:
    """tests/test_plan_memory.py's count of what autograd saves, with the all-to-all replaced by a copy."""
    a, b = _copy_exchange()
    with a, b:
        return saved_bytes(model, ids, precision)


def _estimate_saved(config, layout: ParallelDegrees, precision: str, B: int, S: int) -> int:
    (chunk,) = rank_chunks(config, layout, S, 0)
    cost = chunk_cost(config, layout, precision, chunk, B, S)
    return cost.activations + cost.weight_copies + cost.logits_saved


@pytest.mark.parametrize("precision,ep", [("autocast", 2), *(pytest.param(p, e, marks=SLOW) for p, e in (
    ("fp32", 1), ("fp32", 2), ("autocast", 1), ("bf16-pure", 1), ("bf16-pure", 2)))])
def test_saved_activations_match_autograd(precision, ep):
    """One forward's saved tensors (routing, dispatch indices, expert rows with the fixed-slot
    padding, SwiGLU tensors, the stacked expert weights, the combine) equal the model's bytes per
    micro-batch, token ids and loss scalars aside."""
    config = mixtral()
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    model = build_model(config, single_process_mesh(), dtype=dtype)
    _training_moe(model)
    apply_expert_parallel([model], GroupInfo(None, 0, ep))
    B, S = 2, 32
    ids = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    got = _saved_bytes(model, ids, precision)
    est = _estimate_saved(config, ParallelDegrees(dp=ep, ep=ep), precision, B, S)
    assert 0 <= got - est <= 16 * B * S + 4096, (got, est)


@pytest.mark.parametrize("precision,ep", [("autocast", 2), *(pytest.param(p, e, marks=SLOW) for p, e in (
    ("fp32", 1), ("bf16-pure", 2), ("autocast", 1)))])
def test_sequence_parallel_moe_term_is_the_shards_and_matches_autograd(precision, ep):
    """Sequence parallelism at tp = 2: each TP rank's MoE layer runs on its sequence shard, B * S / 2
    tokens (plait.moe.sequence_parallel), so one process running the model's MoE layer on a shard
    saves what one rank saves. The planner's sparse layer under SP differs from the same layer
    without SP by exactly the norms' and the attention input's halving (as for a dense layer) and
    the MoE block's term at B * S / 2 tokens instead of B * S; that term (with the layer's weight
    copies) equals what autograd saves for the shard, expert-parallel dispatch included; the
    full-sequence term (no SP: every TP rank routes every token) is far above it."""
    config = mixtral()
    B, S, tp, h = 2, 32, 2, config.hidden_size
    sp, full = (ParallelDegrees(tp=tp, dp=ep, ep=ep, sequence_parallel=on) for on in (True, False))
    c, r, p = {"fp32": (4, 4, 4), "autocast": (2, 4, 4), "bf16-pure": (2, 2, 2)}[precision]
    autocast = precision == "autocast"
    shape = moe_shape(config)
    assert shape is not None

    def moe(tokens: int) -> int:
        return moe_activation_bytes(shape, h, tokens, ep, compute=c, residual=r, autocast=autocast)

    # the planner's layer: norms (fp32 input, normalised output, rsqrt) and the attention's matmul
    # input at S / tp positions under SP; attention at the local heads either way; MoE at the shard
    halved = S - S // tp
    dense_part = 2 * (B * halved * h * (4 + r) + 4 * B * halved) + B * halved * h * c
    assert layer_activation_bytes(config, full, precision, B, S, 0) - layer_activation_bytes(
        config, sp, precision, B, S, 0) == dense_part + moe(B * S) - moe(B * S // tp)
    est = moe(B * S // tp) + moe_weight_copies(shape, h, ep, compute=c, param=p, autocast=autocast)

    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    model = build_model(config, single_process_mesh(), dtype=dtype)
    _training_moe(model)
    apply_expert_parallel([model], GroupInfo(None, 0, ep))
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    params = {q.untyped_storage().data_ptr() for q in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    # the rank's shard of the normalised residual stream, in the residual dtype
    shard = torch.randn(B, S // tp, h, dtype=torch.float32 if r == 4 else torch.bfloat16, requires_grad=True)
    a, b = _copy_exchange()
    with a, b, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        layer(shard)
    got = sum(seen.values())
    assert 0 <= got - est <= 64, (got, est)  # the aux loss's [E] vectors
    full_est = moe(B * S) + moe_weight_copies(shape, h, ep, compute=c, param=p, autocast=autocast)
    assert full_est - got > (moe(B * S) - moe(B * S // tp)) // 2  # the negative control


@pytest.mark.parametrize("precision,gate", [("autocast", True), ("bf16-pure", False),
                                            pytest.param("fp32", True, marks=SLOW),
                                            pytest.param("autocast", False, marks=SLOW)])
def test_shared_expert_layer_terms(precision, gate):
    """An MoE layer with a shared expert (and its sigmoid gate), the option no shipped family uses
    yet: its parameters and what one forward saves (activations and weight copies) equal the
    planner's terms, up to the run ends and the aux loss's [E] vectors."""
    h, E, w, ws, k, T = 64, 4, 96, 80, 2, 48
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    torch.manual_seed(0)
    layer = MoELayer(h, E, w, SoftmaxTopKRouter(h, E, k, dtype=dtype), shared_intermediate_size=ws,
                     shared_expert_gate=gate, dtype=dtype)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    layer.aux_loss_scale, layer.z_loss_scale = 0.01, 0.001
    shape = MoEShape(E, k, w, frozenset([0]), renormalize=True, shared_width=ws, shared_gate=gate)
    assert sum(p.numel() for p in layer.parameters()) == shared_parameter_count(shape, h) \
        + expert_parameter_count(shape, h, 1)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    x = torch.randn(T, h, dtype=dtype, requires_grad=True)  # the normalised layer input
    autocast = precision == "autocast"
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        layer(x)
    c, r, p = (4, 4, 4) if precision == "fp32" else (2, 4, 4) if autocast else (2, 2, 2)
    est = moe_activation_bytes(shape, h, T, 1, compute=c, residual=r, autocast=autocast) \
        + moe_weight_copies(shape, h, 1, compute=c, param=p, autocast=autocast)
    assert 0 <= sum(seen.values()) - est <= 64, (sum(seen.values()), est)


@pytest.mark.slow
def test_qwen3_moe_activations_differ_from_autograd_only_as_dense_qwen3_does():
    """Qwen3-MoE (one dense layer, three sparse): the estimate misses exactly what it misses for a
    dense Qwen3 of the same attention (the per-head q/k norms' tensors, not modelled for any Qwen3)."""
    B, S = 2, 32
    ids = torch.randint(0, 1001, (B, S), generator=torch.Generator().manual_seed(0))
    gaps = []
    for config in (qwen3_moe(), Qwen3Config(vocab_size=1001, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16)):
        model = build_model(config, single_process_mesh())
        _training_moe(model)
        gaps.append(_saved_bytes(model, ids, "fp32") - _estimate_saved(config, ParallelDegrees(), "fp32", B, S))
    assert abs(gaps[0] - gaps[1]) <= 16 * B * S + 4096, gaps


def test_expert_rows_grow_with_ep_under_fixed_slots():
    """The expert side holds ep * N rows (one slot of N per peer): saved activations grow with ep
    while parameters shrink."""
    config = recipe_config("mixtral-8x7b.yaml")
    kw = dict(precision="bf16-mixed", micro_batch_size=1, seq_len=4096, microbatches=8)
    one, eight = (estimate_memory(config, ParallelDegrees(pp=4, dp=8, ep=ep), stage=0, **kw) for ep in (1, 8))
    assert eight.activations > one.activations and eight.parameters < one.parameters
    # the exchange's send and receive buffers of one layer: 2 * ep * N * h * r
    assert eight.comm_buffers - one.comm_buffers == 2 * 8 * 4096 * 2 * 4096 * 2


def test_sequence_parallel_memory_is_the_shards():
    """Mixtral-8x7B at tp = 2: with SP a rank's exchange buffers hold its shard's rows (half), and
    the backward's workspace (the stacked expert-weight gradient) gains the copy of one expert
    projection's gradient that the TP gradient hook all-reduces (bf16-mixed: c = p = 2)."""
    config = recipe_config("mixtral-8x7b.yaml")
    kw = dict(precision="bf16-mixed", micro_batch_size=1, seq_len=4096, microbatches=8)
    base = ParallelDegrees(tp=2, pp=4, dp=8, ep=2)
    sp = dataclasses.replace(base, sequence_parallel=True)
    one, two = (estimate_memory(config, lay, stage=1, **kw) for lay in (base, sp))
    assert two.activations < one.activations
    # comm buffers: the exchange's 2 * ep * N * h * r halves with the tokens; SP adds attention's
    # gathered [B, S, h] input and halves the pipeline's B * S * h * r transfers (in flight: p2p)
    h, S = 4096, 4096
    exchange = 2 * 2 * S * 2 * h * 2  # ep = 2, N = S * k rows at k = 2, bf16
    (chunk,) = rank_chunks(config, base, S, 1)
    c_one, c_two = (chunk_cost(config, lay, "bf16-mixed", chunk, 1, S) for lay in (base, sp))
    assert c_one.backward_transient == 4 * h * 14336 * 2  # E / ep = 4 stacked projections
    assert c_two.backward_transient - c_one.backward_transient == h * 14336 * 2
    p2p = {lay: m.comm_buffers - (exchange // (2 if lay.sequence_parallel else 1))
           - (S * h * 2 if lay.sequence_parallel else 0) for lay, m in ((base, one), (sp, two))}
    assert p2p[sp] * 2 == p2p[base] > 0


# ------------------------------------------------------------------------------ all-to-all
@pytest.mark.parametrize("precision,ep,ckpt", [("autocast", 2, "full"), pytest.param("fp32", 2, "none", marks=SLOW),
                                               pytest.param("autocast", 4, "none", marks=SLOW),
                                               pytest.param("bf16-pure", 4, "full", marks=SLOW)])
def test_all_to_all_volume_equals_what_the_dispatcher_sends(precision, ep, ckpt):
    """Forward and backward of a one-layer Mixtral at ``ep``: the bytes handed to the exchange
    (tokens, outputs, counts; their gradients; the recomputed forward under full checkpointing),
    of which ``(ep - 1)/ep`` leave the rank, equal ``all_to_all_bytes``."""
    config = mixtral(num_hidden_layers=1, num_local_experts=8)
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    model = build_model(config, single_process_mesh(), dtype=dtype).train()
    apply_expert_parallel([model], GroupInfo(None, 0, ep))
    if ckpt == "full":
        apply_activation_checkpointing([model], "full")
    sent: list[int] = []

    def record(x, group):
        sent.append(x.numel() * x.element_size())
        return x.clone()

    B, S = 2, 16
    ids = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    patch_rows, patch_counts = (mock.patch(f"plait.moe.{module}.exchange", record)
                                for module in ("all_to_all", "expert_parallel"))
    with patch_rows, patch_counts, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        model(ids, ids).backward()
    assert len(sent) == (8 if ckpt == "full" else 5)  # per forward: counts, tokens, outputs; 2 gradients
    pb = {"fp32": (4, 4), "autocast": (2, 4), "bf16-pure": (2, 2)}[precision]
    est = all_to_all_bytes(moe_shape(config), config.hidden_size, B * S, ep, compute=pb[0], residual=pb[1],
                           recompute=ckpt == "full")
    assert sum(sent) * (ep - 1) / ep == pytest.approx(est, rel=1e-12)
    # hand count: (ep - 1) * N rows of h leave per exchange, N = B*S*k
    rows = (ep - 1) * B * S * 2 * config.hidden_size
    forwards = 2 if ckpt == "full" else 1
    assert est == pytest.approx(forwards * (rows * sum(pb) + (ep - 1) / ep * 8 * 8) + rows * sum(pb))


def test_step_time_counts_active_experts_and_the_all_to_all():
    config = recipe_config("mixtral-8x7b.yaml")
    h100 = get_device("h100")
    kw = dict(precision="bf16-mixed", micro_batch_size=1, seq_len=4096, microbatches=16)
    t1 = estimate_step_time(config, ParallelDegrees(pp=4, dp=16), h100, **kw)
    t8 = estimate_step_time(config, ParallelDegrees(pp=4, dp=16, ep=8), h100, **kw)
    # the same FLOPs (balanced routing), k = 2 experts per token: MFU's model FLOPs over executed
    assert t1.flops_per_rank == t8.flops_per_rank
    assert t1.ep_comm_s == 0 and t8.ep_comm_s > 0
    # on the critical path, stretched by the bubble like the compute
    assert t8.total_s == pytest.approx((t8.compute_s + t8.ep_comm_s) / (1 - t8.bubble_share) + t8.pp_comm_s
                                       + t8.dp_exposed_s)
    # 8 sparse layers per stage, 16 micro-batches, each (ep-1)*N rows out, four exchanges of bf16
    assert t8.ep_bytes == pytest.approx(8 * 16 * (4 * 7 * 4096 * 2 * 4096 * 2 + 7 / 8 * 64))
    assert t8.ep_comm_s == pytest.approx(t8.ep_bytes / 450e9)  # T * ep = 8 ranks: one node's NVLink
    # expert gradients reduce over dp/ep = 2 ranks instead of 16: less DP traffic
    assert t8.dp_comm_s < t1.dp_comm_s
    # executed FLOPs over the pipeline ranks = PaLM's model FLOPs with the k active experts (less the
    # norm weights, which the model count includes and no matmul reads)
    tokens = 16 * 4096
    executed = sum(rank_flops(config, ParallelDegrees(pp=4, dp=16), 4096, 1, 16, r) for r in range(4))
    norms = 6 * (2 * 4096 * 32 + 4096) * tokens
    assert executed == pytest.approx(t1.model_flops / 16 - norms, rel=1e-12)


def test_sequence_parallel_divides_expert_flops_and_all_to_all_by_tp():
    """Under SP each TP rank routes and computes its 1/tp shard: per rank, the router and active
    experts' FLOPs (recomputation included) and the all-to-all rows fall by tp, attention's stay."""
    config = recipe_config("mixtral-8x7b.yaml")
    shape = moe_shape(config)
    assert shape is not None
    h, m, S = config.hidden_size, 16, 4096
    kw = dict(precision="bf16-mixed", micro_batch_size=1, seq_len=S, microbatches=m)
    base = ParallelDegrees(tp=2, pp=4, dp=8, ep=2, activation_checkpointing="full")
    sp = dataclasses.replace(base, sequence_parallel=True)
    active = shared_parameter_count(shape, h) + 2 * 3 * h * shape.width  # router + k = 2 experts per token
    for r in range(4):
        layers = sum(len(ch.layers) for ch in rank_chunks(config, base, S, r))
        saved = rank_flops(config, base, S, 1, m, r) - rank_flops(config, sp, S, 1, m, r)
        assert saved == pytest.approx(m * S * layers * 6 * active / 2 * 4 / 3, rel=1e-12)  # half, and its recompute
    h100 = get_device("h100")
    t_base, t_sp = (estimate_step_time(config, lay, h100, **kw) for lay in (base, sp))
    per_layer = {lay: all_to_all_bytes(shape, h, tokens, 2, compute=2, residual=2, recompute=True)
                 for lay, tokens in ((base, S), (sp, S // 2))}
    assert t_base.ep_bytes == pytest.approx(8 * m * per_layer[base], rel=1e-12)  # 8 sparse layers per stage
    assert t_sp.ep_bytes == pytest.approx(8 * m * per_layer[sp], rel=1e-12)
    assert t_sp.ep_bytes == pytest.approx(t_base.ep_bytes / 2, rel=1e-6)  # the counts do not halve
    assert t_sp.compute_s < t_base.compute_s and t_sp.ep_comm_s < t_base.ep_comm_s


@pytest.mark.parametrize("sp", [False, True])
def test_tp_volume_of_sparse_layers(sp):
    """A sparse layer's TP traffic is its attention half's (the MoE layer is whole on every TP rank):
    4 ring units of the activation without SP, 5 with it; under SP each micro-batch also all-reduces
    every MoE parameter's gradient (autograd's, bf16 here) and the E + 1 routing counts over TP.
    Hand count on one pipeline stage (embedding and head terms as for Llama)."""
    config = recipe_config("mixtral-8x7b.yaml")
    shape = moe_shape(config)
    assert shape is not None
    h, m, S, E = config.hidden_size, 2, 4096, 8
    layout = ParallelDegrees(tp=2, dp=32, ep=2, sequence_parallel=sp)
    t = estimate_step_time(config, layout, get_device("h100"), precision="bf16-mixed", micro_batch_size=1,
                           seq_len=S, microbatches=m)
    A, ring = S * h * 2, 1 / 2
    moe_params = E * h + E // 2 * 3 * h * shape.width
    assert moe_parameter_count(shape, h, 2) == moe_params
    grads = 2 * ring * (moe_params * 2 + (E + 1) * 8)
    assert sequence_parallel_tp_bytes(shape, h, 2, 2, grad=2) == pytest.approx(grads)
    layer = (5 * ring * A + grads) if sp else 4 * ring * A
    ends = 2 * ring * S * h * 2 + (3 if sp else 2) * ring * A  # embedding, head
    assert t.tp_comm_s == pytest.approx(m * (32 * layer + ends) / 450e9, rel=1e-12)


# ------------------------------------------------------------------------------ search
def test_search_picks_ep_when_memory_requires_it_and_tries_sp():
    """Mixtral-8x7B on 64 H100 with at most 4 pipeline stages and ZeRO-1 at most: no layout with
    ep = 1 fits (every rank holds all experts of its layers), so the recommendation splits the
    experts (ZeRO-2 and ZeRO-3 would make ep = 1 fit: tests/test_plan_search.py); each ep divides
    the expert count and dp. Every tp > 1 layout is tried with sequence parallelism off and on (it
    saves the repeated expert work but sums the MoE gradients over TP each micro-batch), and only
    off with ``moe_sequence_parallel=False`` (a recipe with a capacity factor, which SP refuses)."""
    config = recipe_config("mixtral-8x7b.yaml")
    options = SearchOptions(max_tp=1, max_pp=4, max_vpp=1, schedules=("1f1b",), activation_checkpointing=("full",),
                            zero_levels=(0, 1))
    kw = dict(micro_batch_size=1, seq_len=4096, global_batch_size=256, precision="bf16-mixed")
    plan = rank_layouts(config, 64, "h100", options=options, **kw)
    assert plan.recommended is not None and plan.recommended.layout.ep > 1
    assert {c.layout.ep for c in plan.candidates} == {1, 2, 4, 8}
    assert all(c.layout.dp % c.layout.ep == 0 and 8 % c.layout.ep == 0 for c in plan.candidates)
    only_one = rank_layouts(config, 64, "h100", options=dataclasses.replace(options, expert_parallel=1),
                            require_fit=False, **kw)
    assert only_one.recommended is None  # the negative control
    wide = enumerate_layouts(config, 64, seq_len=4096, options=SearchOptions(max_vpp=1, schedules=("1f1b",)))
    assert {layout.ep for layout in wide} == {1, 2, 4, 8}
    assert not any(layout.sequence_parallel for layout in wide if layout.tp == 1)
    tp_layouts = [layout for layout in wide if layout.tp > 1]
    assert tp_layouts and {layout.tp for layout in tp_layouts} == {2, 4, 8}
    with_sp = {layout for layout in tp_layouts if layout.sequence_parallel}
    assert with_sp and {dataclasses.replace(layout, sequence_parallel=True) for layout in tp_layouts} == with_sp
    assert len(tp_layouts) == 2 * len(with_sp)  # each one off and on
    off = enumerate_layouts(config, 64, seq_len=4096,
                            options=SearchOptions(max_vpp=1, schedules=("1f1b",), moe_sequence_parallel=False))
    assert set(off) == {layout for layout in wide if not layout.sequence_parallel}


def test_plan_output_shows_ep_and_the_expert_terms():
    """The table's layout label carries ep, the recommendation an ``experts:`` line (expert and dense
    parameters, where ZeRO-1 shards them, the all-to-all bytes) and overrides that set
    ``parallel.ep`` and validate as the recipe at that world."""
    from plait.commands.plan import render_plan
    from plait.config import load_recipe, validate_recipe

    config = recipe_config("mixtral-8x7b.yaml")
    options = SearchOptions(max_tp=1, max_pp=4, max_vpp=1, schedules=("1f1b",), activation_checkpointing=("full",))
    plan = rank_layouts(config, 64, "h100", micro_batch_size=1, seq_len=4096, global_batch_size=256,
                        precision="bf16-mixed", options=options)
    rec = plan.recommended
    assert rec is not None and rec.layout.ep > 1
    text = render_plan(plan, config, "mixtral-8x7b", top=5)
    assert f"ep{rec.layout.ep}" in text and "all-to-all" in text
    experts = next(line for line in text.splitlines() if line.strip().startswith("experts:"))
    assert f"ep={rec.layout.ep}" in experts and f"dp/ep={rec.layout.dp // rec.layout.ep}" in experts
    overrides = next(line for line in text.splitlines() if "recipe overrides:" in line).split(": ", 1)[1].split()
    assert f"parallel.ep={rec.layout.ep}" in overrides
    items = ["data.global_batch_size=256", *overrides]
    resolved = validate_recipe(load_recipe(str(RECIPES / "mixtral-8x7b.yaml"), items).model_dump(), 64,
                               check_paths=False)
    assert resolved.recipe.parallel.ep == rec.layout.ep and resolved.dp == rec.layout.dp


def test_moe_search_requires_tp_to_divide_intermediate_size_as_the_build_does():
    """The experts are never split over TP, yet the MoE TP plan runs Llama's first, which builds a
    parallel dense MLP for every block (then swaps the MoE layer back) and so refuses a tp that does
    not divide ``intermediate_size``. The search keeps that rule so that it never recommends a layout
    the build refuses; lifting it needs the build (and the recipe rule) changed first."""
    config = mixtral(intermediate_size=97)
    with pytest.raises(ValueError, match="intermediate_size=97 is not divisible by tp=2"):
        build_model(config, ParallelMesh(2, 0, tp=2, create_groups=False), device="meta", init=False)
    layouts = enumerate_layouts(config, 2, devices_per_node=2, seq_len=64, global_batch_size=8)
    assert layouts and {layout.tp for layout in layouts} == {1}
    assert {layout.tp for layout in enumerate_layouts(mixtral(), 2, devices_per_node=2, seq_len=64,
                                                      global_batch_size=8)} == {1, 2}  # 96: tp=2 divides it


def test_dense_search_has_only_ep_one():
    from plait.models.llama.config import LlamaConfig

    config = LlamaConfig(vocab_size=250, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)
    layouts = enumerate_layouts(config, 8, seq_len=64, global_batch_size=64)
    assert layouts and {layout.ep for layout in layouts} == {1}


#: llama3-8b.yaml on 8 H100, seq 2048, global batch 32, autocast: total bytes and step seconds of
#: four layouts as the planner gave them before it modelled MoE (commit 00e3cf6)
DENSE_BEFORE = [
    (ParallelDegrees(tp=1, pp=1, dp=8, zero=1), 4, 110906750976, 0.8614413156354208),
    (ParallelDegrees(tp=1, pp=2, dp=4, activation_checkpointing="full"), 8, 70439272448, 1.2196076494500805),
    (ParallelDegrees(tp=2, pp=2, dp=2, sequence_parallel=True, zero=1), 16, 44859523072, 0.9138737593973882),
    (ParallelDegrees(tp=4, pp=2, dp=1, sequence_parallel=True, activation_checkpointing="full"), 32, 17629839360,
     1.315508040641833),
]


@pytest.mark.parametrize("layout,m,total,seconds", DENSE_BEFORE)
def test_dense_plan_is_unchanged(layout, m, total, seconds):
    """The negative control: a dense recipe's memory and time are those of the planner before MoE."""
    from plait.models.llama.parallelize import kv_replication_for

    config = recipe_config("llama3-8b.yaml")
    layout = dataclasses.replace(layout, kv_replication=kv_replication_for(config, layout.tp))
    kw = dict(precision="autocast", micro_batch_size=1, seq_len=2048, microbatches=m)
    assert estimate_memory(config, layout, **kw).total == total
    assert estimate_step_time(config, layout, get_device("h100"), **kw).total_s == pytest.approx(seconds, rel=1e-12)


# ------------------------------------------------------------------------------ dry run, command
@pytest.mark.parametrize("sp", [False, True])
def test_dry_run_of_an_expert_parallel_layout_matches(sp):
    """The build of an expert-parallel rank, with sequence parallelism too (the MoE gradient hooks
    skip meta parameters), has the estimated parameters and experts."""
    from plait.plan.dry_run import dry_run

    config = qwen3_moe()
    layout = ParallelDegrees(tp=2, pp=2, dp=2, ep=2, zero=1, sequence_parallel=sp)
    for rank in (0, 7):
        report = dry_run(config, layout, 8, rank, precision="bf16-mixed", seq_len=64, microbatches=4)
        assert report.matches_exactly, report.check_line()
        assert report.group_sizes["ep"] == 2 and report.expert_param_count == report.estimated_expert_param_count > 0


#: the recipe's comment: the overrides of the layout ``plait plan`` recommends on 128 GPUs
MIXTRAL_128 = ["parallel.pp=4", "parallel.ep=2", "parallel.microbatches=32"]


@pytest.mark.slow
@pytest.mark.parametrize("world,overrides", [(64, []), (128, MIXTRAL_128)])
def test_mixtral_recipe_is_the_plan_and_its_dry_run_matches(world, overrides):
    """recipes/mixtral-8x7b.yaml on 64 GPUs, and with its commented overrides on 128: the layout
    validates, is the planner's recommendation (searched over tp = 1 and full checkpointing, the
    subset the whole search's recommendation lies in, sequence-parallel tp > 1 layouts included;
    the whole search is ~1 min per world) and its first and
    last ranks build on the fake process group with the estimated parameters and experts."""
    from plait.commands.plan import load_plan_inputs
    from plait.config import load_recipe, validate_recipe
    from plait.plan.dry_run import dry_run

    path = str(RECIPES / "mixtral-8x7b.yaml")
    resolved = validate_recipe(load_recipe(path, overrides).model_dump(), world, check_paths=False)
    p = resolved.recipe.parallel
    layout = ParallelDegrees(tp=p.tp, pp=p.pp, dp=resolved.dp, vpp=p.vpp, ep=p.ep, zero=p.zero_level(),
                             schedule=p.schedule,
                    activation_checkpointing=resolved.recipe.train.activation_checkpointing, kv_replication=1)
    config = load_plan_inputs(path, [])[1]
    options = SearchOptions(max_tp=1, activation_checkpointing=("full",), all_kv_replications=False)
    plan = rank_layouts(config, world, "h100", micro_batch_size=1, seq_len=4096, global_batch_size=1024,
                        precision=resolved.recipe.precision.preset, options=options)
    assert plan.recommended is not None
    assert plan.recommended.layout == layout and plan.recommended.microbatches == p.microbatches
    for rank in (0, world - 1):
        report = dry_run(config, layout, world, rank, precision="bf16-mixed", seq_len=4096, microbatches=p.microbatches)
        assert report.matches_exactly, report.check_line()


def test_plan_command_keeps_sequence_parallelism_off_for_a_capacity_factor(capsys, tmp_path, monkeypatch):
    """``plait plan`` searches SP for an MoE recipe at tp > 1, and not when the recipe sets a capacity
    factor (which SP refuses)."""
    from plait.cli import main

    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    argv = ["plan", str(RECIPES / "moe-tiny.yaml"), "--world", "4", "--device", "h100", "--all", "--top", "200"]
    layouts = []
    for extra in ([], ["moe.capacity_factor=1.25"]):
        assert main([argv[0], argv[1], *extra, *argv[2:]]) == 0
        rows = [line.split()[1:5] for line in capsys.readouterr().out.splitlines() if " tp2 " in f" {line} "]
        layouts.append(rows)
    assert any("sp" in row for row in layouts[0]) and layouts[1]
    assert not any("sp" in row for row in layouts[1])
