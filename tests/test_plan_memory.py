"""Memory and step-time models of a layout (plait.plan.memory, plait.plan.timing).

Parameter bytes are compared with the local parameters the real build allocates (on the meta
device, rank-arithmetic mesh); model-state bytes with the buffers ``DistributedOptimizer`` really
allocates; saved-activation bytes with what autograd actually saves in one forward of a tiny
model (saved-tensor hooks, one process, the ``fake`` backend for TP > 1) and, with activation
checkpointing, with the tensors a forward leaves alive (a dispatch mode that keeps a weak
reference to every storage it creates). The measured peak-RSS comparison is in
docs/plan_memory.md (bench/measure_memory.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from builders import build_llama, build_llama_stages
from plait.activation_checkpointing import apply_activation_checkpointing
from plait.comm.primitives import GroupInfo
from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
from plait.devices import get_device
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.llama.config import LlamaConfig
from plait.models.llama.parallelize import kv_replication_for
from plait.pipeline.simulate import simulate, theoretical_bubble
from plait.plan.degrees import ParallelDegrees
from plait.plan.memory import (
    MemoryBreakdown,
    chunk_cost,
    estimate_memory,
    layer_activation_bytes,
    local_shapes,
    rank_chunks,
    rank_parameter_count,
)
from plait.plan.pipeline_split import plan_partition
from plait.plan.timing import estimate_step_time
from plait.precision import policy_for
from plait.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


def _config(**kw) -> LlamaConfig:
    base = dict(vocab_size=1001, hidden_size=240, intermediate_size=640, num_hidden_layers=6,
                num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    base.update(kw)
    return LlamaConfig(**base)


def _layout(config, **kw) -> ParallelDegrees:
    tp = kw.get("tp", 1)
    kw.setdefault("kv_replication", kv_replication_for(config, tp))
    return ParallelDegrees(**kw)


def _built_params(config, layout: ParallelDegrees, rank: int, seq_len: int) -> int:
    mesh = ParallelMesh(layout.world, rank, tp=layout.tp, pp=layout.pp, dp=layout.dp,
                        kv_replication=layout.kv_replication, create_groups=False)
    if layout.pp == 1:
        modules = [build_llama(config, mesh, device="meta", init=False)]
    else:
        split = plan_partition(config, layout.pp * layout.vpp, seq_len).stage_layers()
        modules = build_llama_stages(config, mesh, split, device="meta", init=False)
    return sum(p.numel() for m in modules for p in m.parameters()), mesh.pp_rank


# ------------------------------------------------------------------------------ parameters
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("degrees", [
    dict(tp=1), dict(tp=2), dict(tp=4),                      # tp=4: 6 heads padded to 8, KV replicated
    dict(tp=3),                                              # 2 KV heads over 3 ranks: padding KV groups
    dict(tp=1, pp=2), dict(tp=2, pp=2), dict(tp=4, pp=3),
    dict(tp=2, pp=2, vpp=2, schedule="interleaved-1f1b"), dict(tp=2, dp=2),
])
def test_parameter_bytes_equal_the_built_shards(degrees, bias, tied):
    config = _config(tie_word_embeddings=tied, attention_bias=bias, intermediate_size=720)
    layout = _layout(config, **degrees)
    for rank in range(layout.world):
        built, pp_rank = _built_params(config, layout, rank, 64)
        assert rank_parameter_count(config, layout, 64, pp_rank) == built, (degrees, rank)
        est = estimate_memory(config, layout, precision="fp32", micro_batch_size=1, seq_len=64, microbatches=4,
                              stage=pp_rank)
        assert est.parameters == 4 * built and est.gradients == 4 * built
        bf16 = estimate_memory(config, layout, precision="bf16-pure", micro_batch_size=1, seq_len=64,
                               microbatches=4, stage=pp_rank)
        assert bf16.parameters == 2 * built


def test_tied_embedding_is_held_by_both_pipeline_ends():
    config = _config(tie_word_embeddings=True)
    layout = _layout(config, pp=2)
    sh = local_shapes(config, layout)
    embed = sh.vocab * sh.hidden
    counts = [rank_parameter_count(config, layout, 64, r) for r in range(2)]
    assert sum(counts) == config.num_parameters() + embed  # one extra copy, on the last stage
    single = rank_parameter_count(config, _layout(config), 64, 0)
    assert single == config.num_parameters()


def test_head_padding_and_kv_replication_are_counted():
    config = _config()  # 6 query heads, 2 KV heads, head_dim 40
    sh = local_shapes(config, _layout(config, tp=4))
    assert sh.q == 2 * 40 and sh.kv == 1 * 40 and sh.head_padding  # 8 padded heads / 4; KV replicated
    assert sh.vocab == 251 and sh.vocab_padding                     # ceil(1001 / 4)


# ------------------------------------------------------------------------------ activations
def _saved_bytes(model, ids, precision: str) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen.setdefault(key, t.untyped_storage().nbytes())
        return t

    on = precision == "autocast"
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        model(ids, ids)
    return sum(seen.values())


@pytest.mark.parametrize("tp,sp,precision", [
    (1, False, "fp32"), (1, False, "autocast"), (1, False, "bf16-pure"),
    (2, False, "fp32"), (2, False, "autocast"), (2, True, "fp32"), (2, True, "autocast"), (2, True, "bf16-pure"),
    (4, False, "fp32"), (4, True, "autocast"),  # padding heads, replicated KV heads, padded vocabulary
])
def test_saved_activations_match_autograd(tp, sp, precision):
    """One forward's saved tensors equal the model's per-micro-batch bytes (ids and masks aside)."""
    config = _config(num_hidden_layers=2, intermediate_size=512, hidden_size=192)
    layout = _layout(config, tp=tp, sequence_parallel=sp)
    B, S = 2, 64
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    if tp > 1:
        dist.init_process_group("fake", rank=tp - 1, world_size=tp)
    try:
        mesh = ParallelMesh(tp, tp - 1, tp=tp, kv_replication=layout.kv_replication, create_groups=tp > 1)
        model = build_llama(config, mesh, sequence_parallel=sp, dtype=dtype)
        ids = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
        got = _saved_bytes(model, ids, precision)
    finally:
        if tp > 1:
            dist.destroy_process_group()
    (chunk,) = rank_chunks(config, layout, S, 0)
    cost = chunk_cost(config, layout, precision, chunk, B, S)
    est = cost.activations + cost.weight_copies + cost.logits_saved
    # what the model leaves out: int64 token ids / targets and boolean masks, a few KiB
    assert 0 <= got - est <= 16 * B * S + 4096, (got, est)


class _LiveStorages(TorchDispatchMode):
    """Weak references to every storage an op creates (parameters and buffers excluded)."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip, self.refs = skip, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.skip:
                    ref = StorageWeakRef(storage)
                    self.refs[ref.cdata] = (ref, storage.nbytes())
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.refs.values() if not ref.expired())


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("tp,sp,precision", [
    (1, False, "fp32"), (1, False, "autocast"), (1, False, "bf16-pure"), (2, True, "fp32"), (2, False, "autocast"),
    (4, False, "fp32"),  # padding heads: the masked output copy
])
def test_checkpointed_activations_match_live_tensors(tp, sp, precision, mode):
    """With plait's checkpointing applied, the bytes a forward leaves alive (what backward will
    use: saved tensors, checkpointed modules' inputs and outputs, autocast weight copies, the saved
    softmax) equal the model's per-micro-batch bytes (token ids and masks aside)."""
    config = _config(num_hidden_layers=2, intermediate_size=512, hidden_size=192)
    layout = _layout(config, tp=tp, sequence_parallel=sp, activation_checkpointing=mode)
    B, S = 2, 64
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    if tp > 1:
        dist.init_process_group("fake", rank=tp - 1, world_size=tp)
    try:
        mesh = ParallelMesh(tp, tp - 1, tp=tp, kv_replication=layout.kv_replication, create_groups=tp > 1)
        model = build_llama(config, mesh, sequence_parallel=sp, dtype=dtype).train()
        apply_activation_checkpointing([model], mode)
        ids = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
        skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        tracker = _LiveStorages(skip)
        with tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            loss = model(ids, ids)
        got = tracker.live_bytes()
        del loss
    finally:
        if tp > 1:
            dist.destroy_process_group()
    (chunk,) = rank_chunks(config, layout, S, 0)
    cost = chunk_cost(config, layout, precision, chunk, B, S)
    est = cost.activations + cost.weight_copies + cost.logits_saved
    assert 0 <= got - est <= 16 * B * S + 4096, (got, est)


class _PeakStorages(_LiveStorages):
    """:class:`_LiveStorages` that also records the largest live total seen after any op."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__(skip)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peak = max(self.peak, self.live_bytes())
        return out


@pytest.mark.parametrize("precision", ["fp32", "autocast", "bf16-mixed", "bf16-pure"])
def test_vocab_parallel_loss_terms_match_what_the_loss_allocates(precision):
    """The TP > 1 loss terms against the chunked cross-entropy itself, on one TP rank's logits
    (``[N, V']`` in the compute dtype, the head's output): its saved floating tensors are
    ``logits_saved`` (the logits and two fp32 numbers per token, no softmax), the largest forward
    allocation is the fp32 chunk (``forward_transient``) and the backward's the logits gradient plus
    the chunk (``backward_transient``, which the loss sets here). Int64 targets and boolean masks
    (a few bytes per token) are what the model leaves out."""
    config = _config(vocab_size=2048)
    layout = _layout(config, tp=2)
    B, S, V = 2, 256, 1024  # N * V' is twice the loss's default fp32 chunk: two chunks
    N = B * S
    (chunk,) = rank_chunks(config, layout, S, 0)
    cost = chunk_cost(config, layout, precision, chunk, B, S)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=gen).to(dtype).requires_grad_()
    target = torch.randint(0, config.vocab_size, (N,), generator=gen)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    skip = {logits.untyped_storage().data_ptr(), target.untyped_storage().data_ptr()}
    forward = _PeakStorages(skip)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), forward:
        loss = vocab_parallel_cross_entropy(logits, target, config.vocab_size, GroupInfo(None, 0, 2))
    assert sum(t.numel() * t.element_size() for t in saved if t.is_floating_point()) == cost.logits_saved
    small = 64 * N  # per-token vectors: row maximum, sums, int64 targets, masks, the loss
    assert 0 <= forward.peak - cost.forward_transient <= small, (forward.peak, cost.forward_transient)
    grad_out = torch.ones(N)
    backward = _PeakStorages(skip | {grad_out.untyped_storage().data_ptr()})
    with backward:
        loss.backward(grad_out)
    assert 0 <= backward.peak - cost.backward_transient <= small, (backward.peak, cost.backward_transient)


def test_checkpointing_and_sequence_parallelism_reduce_activations():
    config = _config()
    kw = dict(precision="autocast", micro_batch_size=2, seq_len=256, microbatches=4)
    base = _layout(config, tp=2)
    layer = {ck: layer_activation_bytes(config, dataclasses.replace(base, activation_checkpointing=ck), "autocast",
                                        2, 256) for ck in ("none", "selective", "full")}
    assert layer["full"] < layer["selective"] < layer["none"]
    assert layer["full"] == 2 * 256 * 240 * 4  # only the fp32 layer input
    est = {ck: estimate_memory(config, dataclasses.replace(base, activation_checkpointing=ck), **kw)
           for ck in ("none", "selective", "full")}
    assert est["full"].activations < est["selective"].activations < est["none"].activations
    # full checkpointing keeps no layer's weight copies (only the output head's, outside the layers)
    sh = local_shapes(config, base)
    assert est["full"].weight_copies == 2 * sh.vocab * sh.hidden < est["none"].weight_copies
    sp = estimate_memory(config, dataclasses.replace(base, sequence_parallel=True), **kw)
    assert sp.activations < est["none"].activations
    # SP divides exactly the replicated-region tensors (norms, their outputs) by tp
    l_none = layer_activation_bytes(config, base, "fp32", 2, 256)
    l_sp = layer_activation_bytes(config, dataclasses.replace(base, sequence_parallel=True), "fp32", 2, 256)
    replicated = 2 * (2 * 256 * 240 * 8 + 4 * 2 * 256) + 2 * 2 * 256 * 240 * 4
    assert l_none - l_sp == replicated // 2


def test_zero1_divides_optimizer_and_master_by_dp():
    config = _config()
    kw = dict(micro_batch_size=1, seq_len=64, microbatches=2)
    for dp in (2, 4, 7):
        plain = estimate_memory(config, _layout(config, dp=dp), precision="bf16-mixed", **kw)
        zero = estimate_memory(config, _layout(config, dp=dp, zero=1), precision="bf16-mixed", **kw)
        P = plain.parameter_count
        own = -(-P // dp)
        # bf16 weights, fp32 gradient buffer, fp32 master and AdamW state
        assert plain.parameters == 2 * P and plain.gradients == 4 * P and plain.gradient_shard == 0
        assert plain.optimizer == 2 * P * 4 and plain.master_weights == P * 4
        assert zero.optimizer == 2 * own * 4 and zero.master_weights == own * 4
        assert zero.parameters == plain.parameters and zero.gradients == plain.gradients
        assert zero.gradient_shard == own * 4 and zero.step_buffers == own * 2  # bf16 all-gather staging
        assert zero.model_states == plain.parameters + plain.gradients + own * 4 * 4
        # fp32 under ZeRO-1 updates its owned range of the weights in place: no master shard
        f32 = estimate_memory(config, _layout(config, dp=dp, zero=1), precision="fp32", **kw)
        assert f32.master_weights == 0 and f32.gradient_shard == own * 4 and f32.step_buffers == own * 4
        assert estimate_memory(config, _layout(config, dp=dp), precision="fp32", **kw).master_weights == 0
    pure = estimate_memory(config, _layout(config), precision="bf16-pure", **kw)
    assert pure.optimizer == 2 * pure.parameter_count * 2 and pure.master_weights == 0
    assert pure.gradients == 2 * pure.parameter_count
    # bf16-pure's step: the larger of the norm's fp32 copy of every gradient (here) and
    # LowPrecisionAdamW's eight fp32 working copies of the largest weight (the embedding)
    assert pure.step_buffers == max(4 * pure.parameter_count, 8 * 4 * config.vocab_size * config.hidden_size)
    # ZeRO-1 with dp = 1 trains unsharded (the optimizer warns): nothing changes
    one = estimate_memory(config, _layout(config, zero=1), precision="fp32", **kw)
    assert one.total == estimate_memory(config, _layout(config), precision="fp32", **kw).total


@pytest.mark.parametrize("precision", ["fp32", "autocast", "bf16-mixed", "bf16-pure"])
@pytest.mark.parametrize("dp,zero", [(1, False), (4, False), (4, True), (3, True)])
def test_model_states_equal_the_optimizer_buffers(precision, dp, zero):
    """parameters / gradients / gradient_shard / master / optimizer bytes equal what a real
    DistributedOptimizer allocates, up to the bucket padding (at most dp - 1 elements a bucket)."""
    config = _config(num_hidden_layers=2)
    layout = _layout(config, dp=dp, zero=int(zero))
    est = estimate_memory(config, layout, precision=precision, micro_batch_size=1, seq_len=32, microbatches=1)
    model = build_llama(config, single_process_mesh(), seed=0)
    hyper = OptimizerHyper(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    # a data-parallel rank of a group that is never used for a collective (construction and the
    # inner step do not communicate); small buckets so that padding and shards are exercised
    opt = DistributedOptimizer([model], policy_for(precision), hyper, dp=GroupInfo(None, dp - 1, dp),
                               tp=GroupInfo.single(), zero=zero, bucket_mb=0.25)
    opt.inner.step()  # AdamW allocates its states in the first step

    def nbytes(t):
        return t.numel() * t.element_size()

    pad = (opt.shards - 1) * len(opt.bucket_plan.buckets)  # padding elements: at most shards - 1 a bucket
    report = opt.memory_report()
    got = {"parameters": nbytes(opt.param_data), "gradients": nbytes(opt.grads.data),
           "gradient_shard": nbytes(opt.grads.shard_data) if zero else 0,
           "master_weights": report["master_bytes"], "optimizer": report["optimizer_state_bytes"]}
    for name, value in got.items():  # padding: at most 4 bytes an element, 2 AdamW states
        assert abs(value - getattr(est, name)) <= 8 * pad, (name, value, getattr(est, name))
    assert len(opt.bucket_plan.buckets) > 2  # several buckets, each sharded separately


def test_in_flight_microbatches_follow_the_schedule():
    config = _config(num_hidden_layers=8)
    kw = dict(precision="fp32", micro_batch_size=1, seq_len=64)
    for m in (2, 4, 8):
        for r in range(4):
            one = estimate_memory(config, _layout(config, pp=4), microbatches=m, stage=r, **kw)
            assert one.max_in_flight == min(4 - r, m)
            gpipe = estimate_memory(config, _layout(config, pp=4, schedule="gpipe"), microbatches=m, stage=r, **kw)
            assert gpipe.max_in_flight == m
            # with activations dominating, GPipe's peak is all m in flight; the flat gradient
            # buffer is alive there too (it lives through the step)
            big = estimate_memory(config, _layout(config, pp=4, schedule="gpipe"), microbatches=m, stage=r,
                                  precision="fp32", micro_batch_size=4, seq_len=1024)
            assert big.in_flight == {r: m} and big.gradients_at_peak == big.gradients > 0
    # interleaved: the peak total of in-flight chunks equals the simulator's high-water mark
    layout = _layout(config, pp=2, vpp=2, schedule="interleaved-1f1b")
    sim = simulate(2, 4, 2, "interleaved-1f1b")
    for r in range(2):
        est = estimate_memory(config, layout, microbatches=4, stage=r, **kw)
        assert est.max_in_flight == sim.peak_in_flight[r]
        assert sum(est.in_flight.values()) <= est.max_in_flight


def test_worst_rank_and_report_helpers():
    config = _config()
    layout = _layout(config, pp=2)
    kw = dict(precision="autocast", micro_batch_size=2, seq_len=128, microbatches=4)
    ranks = [estimate_memory(config, layout, stage=r, **kw) for r in range(2)]
    worst = estimate_memory(config, layout, **kw)
    assert worst.total == max(b.total for b in ranks)
    d = worst.as_dict()
    assert d["total"] == worst.total and set(MemoryBreakdown.FIELDS) <= set(d)
    assert worst.total == worst.parameters + worst.optimizer + worst.master_weights + worst.gradient_shard + max(
        worst.activation_phase, worst.step_phase)
    header, row = MemoryBreakdown.table_header(), worst.table_row()
    assert row.count("|") == header.splitlines()[0].count("|") == header.splitlines()[1].count("|")
    with pytest.raises(ValueError, match="precision='fp8'"):
        estimate_memory(config, layout, **{**kw, "precision": "fp8"})
    with pytest.raises(ValueError, match="stage=2"):
        estimate_memory(config, layout, stage=2, **kw)


def test_gradient_buffer_is_alive_at_every_peak():
    """The flat gradient buffer is allocated once: even one micro-batch has it at the peak, and
    accumulation over more micro-batches adds nothing (without pipeline, one in flight)."""
    config = _config()
    kw = dict(precision="fp32", micro_batch_size=2, seq_len=128)
    one = estimate_memory(config, _layout(config), microbatches=1, **kw)
    two = estimate_memory(config, _layout(config), microbatches=2, **kw)
    assert one.gradients_at_peak == one.gradients == two.gradients_at_peak
    assert one.total == two.total


# ------------------------------------------------------------------------------ timing
def test_step_time_monotonic_and_bubble():
    config = _config(num_hidden_layers=8, hidden_size=256, intermediate_size=768, num_attention_heads=8,
                     num_key_value_heads=4)
    h100 = get_device("h100")
    kw = dict(precision="autocast", micro_batch_size=1, seq_len=512, microbatches=8)
    by_tp = {tp: estimate_step_time(config, _layout(config, tp=tp, dp=8 // tp), h100, **kw) for tp in (1, 2, 4, 8)}
    computes = [by_tp[tp].compute_s for tp in (1, 2, 4, 8)]
    assert computes == sorted(computes, reverse=True) and len(set(computes)) == 4
    assert by_tp[1].tp_comm_s == 0 < by_tp[2].tp_comm_s
    assert by_tp[8].dp_comm_s == 0 < by_tp[1].dp_comm_s
    for r in by_tp.values():
        assert r.total_s >= r.compute_s and 0 < r.mfu <= r.efficiency

    for pp, vpp, m in ((2, 1, 4), (4, 1, 8), (4, 2, 8)):
        sched = "interleaved-1f1b" if vpp > 1 else "1f1b"
        t = estimate_step_time(config, _layout(config, pp=pp, vpp=vpp, schedule=sched), h100,
                               **{**kw, "microbatches": m})
        assert t.bubble_share == pytest.approx((pp - 1) / (vpp * m + pp - 1))
        assert t.bubble_share == pytest.approx(theoretical_bubble(pp, m, vpp))
        assert t.total_s == pytest.approx((t.compute_s + t.tp_comm_s) / (1 - t.bubble_share) + t.pp_comm_s
                                          + 0.5 * t.dp_comm_s)
    few = estimate_step_time(config, _layout(config, pp=4), h100, **{**kw, "microbatches": 4})
    many = estimate_step_time(config, _layout(config, pp=4), h100, **{**kw, "microbatches": 32})
    assert many.bubble_share < few.bubble_share and many.mfu > few.mfu


def test_step_time_links_recompute_and_efficiency():
    config = _config(num_hidden_layers=8, hidden_size=256, intermediate_size=768, num_attention_heads=8,
                     num_key_value_heads=4)
    h100 = get_device("h100")
    kw = dict(precision="autocast", micro_batch_size=1, seq_len=512, microbatches=8)
    layout = _layout(config, tp=8, dp=2)
    in_node = estimate_step_time(config, layout, h100, **kw)
    across = estimate_step_time(config, layout, h100, devices_per_node=4, **kw)  # TP group spans 2 nodes
    assert across.tp_comm_s == pytest.approx(in_node.tp_comm_s * (h100.intra_node_bw / 2) / h100.inter_node_bw)
    one_node = estimate_step_time(config, layout, h100, nodes_of=lambda world: 1, **kw)  # 16 per node
    assert in_node.dp_comm_s == pytest.approx(one_node.dp_comm_s * (h100.intra_node_bw / 2) / h100.inter_node_bw)
    full = estimate_step_time(config, dataclasses.replace(layout, activation_checkpointing="full"), h100, **kw)
    assert full.compute_s > in_node.compute_s and full.mfu < in_node.mfu
    half = estimate_step_time(config, layout, h100, efficiency=0.25, **kw)
    assert half.compute_s == pytest.approx(2 * in_node.compute_s)
    fp32 = estimate_step_time(config, layout, h100, **{**kw, "precision": "fp32"})
    assert fp32.peak_flops == h100.peak_flops["fp32"] and fp32.compute_s > in_node.compute_s


@pytest.mark.parametrize("split, unsplit, vpp", [("zb-h1", "1f1b", 1), ("interleaved-zb", "interleaved-1f1b", 2)])
def test_zero_bubble_schedules_hold_their_parents_activations(split, unsplit, vpp):
    """A zero-bubble schedule runs its parent's forwards and backwards in the same order (its W tasks
    only add the deferred weight-gradient working sets, not priced): the walked peak is the parent's,
    never less (a W counted as a second backward would free a micro-batch twice)."""
    config = _config()
    for pp_rank in range(2):
        est = {name: estimate_memory(config, _layout(config, pp=2, vpp=vpp, schedule=name), precision="fp32",
                                     micro_batch_size=1, seq_len=64, microbatches=4, stage=pp_rank)
               for name in (split, unsplit)}
        assert est[split].total == est[unsplit].total and est[split].activations > 0, (split, pp_rank)
