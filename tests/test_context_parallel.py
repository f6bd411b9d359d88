"""Context parallelism on a whole model: a Llama model whose attention cores and loss were switched
by :func:`plait.context_parallel.apply.apply_context_parallel`, fed this rank's zigzag share of the
batch (:func:`plait.context_parallel.batch.split_token_batch`), gives one process's loss and, with
the parameter gradients averaged over cp as the data-parallel reduction over dp x cp does, its
gradients; plain rows against the same rows on one process, packed rows against the same
documents *unpacked* (each alone in its own row: no document attends to another), ring and
all-gather, alone and with TP=2 + sequence parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_distributed
from plait.context_parallel import SequenceSplit
from plait.context_parallel.balance import balanced_split
from plait.context_parallel.batch import decode_chunks, shifted_targets, split_token_batch
from plait.data.batch import TokenBatch

SEQ = 24
TOL = 2e-5


def _config():
    from plait.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _batch(packed: bool) -> TokenBatch:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (2, SEQ), generator=g)
    if not packed:
        return TokenBatch(input_ids=ids[None])
    starts = [[0, 5, 6, 17], [0, 9, 20]]  # documents across chunk and rank boundaries, one of a token
    seg = torch.zeros(2, SEQ, dtype=torch.long)
    pos = torch.zeros(2, SEQ, dtype=torch.long)
    labels = ids.clone()
    for row, st in enumerate(starts):
        bounds = st + [SEQ]
        for d, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            seg[row, a:b] = d
            pos[row, a:b] = torch.arange(b - a)
            labels[row, a] = -100  # nothing predicts a document's first token
    return TokenBatch(input_ids=ids[None], labels=labels[None], position_ids=pos[None], segment_ids=seg[None])


def _forward(model, tb: TokenBatch):
    return model(tb.input_ids[0], (tb.input_ids if tb.labels is None else tb.labels)[0],
                 position_ids=None if tb.position_ids is None else tb.position_ids[0],
                 segment_ids=None if tb.segment_ids is None else tb.segment_ids[0])


def _unpacked_loss(model, tb: TokenBatch) -> torch.Tensor:
    """The packed batch's loss computed document by document, each alone in its own row: the sum of
    every document's token losses over the batch's target count (what the packed row's mean is)."""
    assert tb.labels is not None and tb.segment_ids is not None
    ids, labels, seg = tb.input_ids[0], tb.labels[0], tb.segment_ids[0]
    targets = int((F.pad(labels[:, 1:], (0, 1), value=-100) != -100).sum())
    loss = torch.zeros(())
    for row in range(ids.shape[0]):
        for doc in seg[row].unique():
            where = seg[row] == doc
            loss = loss + model(ids[row, where][None], labels[row, where][None], loss_normalizer=targets)
    return loss


def _reference(packed: bool):
    from plait.materialize import build_model
    from plait.mesh import single_process_mesh

    model = build_model(_config(), single_process_mesh(), seed=3)
    if packed:
        loss = _unpacked_loss(model, _batch(True))
    else:
        loss = _forward(model, _batch(False))
    loss.backward()
    with torch.no_grad():
        logits = model(_batch(False).input_ids[0, :, :6])
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, logits


def _worker(rank, world, tp, cases):
    from plait.context_parallel.apply import apply_context_parallel, whole_sequences
    from plait.context_parallel.attention import ContextParallel
    from plait.materialize import build_model
    from plait.mesh import ParallelMesh
    from plait.models.llama.parallelize import kv_replication_for
    from tp_gather import full_grads

    cfg = _config()
    mesh = ParallelMesh(world, rank, tp=tp, cp=world // tp, kv_replication=kv_replication_for(cfg, tp))
    cp = mesh.info("cp")
    out = []
    for mode, packed, zigzag in cases:
        model = build_model(cfg, mesh, seed=3, sequence_parallel=tp > 1)
        settings = ContextParallel(cp, tuple(mesh.my_group_ranks("cp")), mode=mode, zigzag=zigzag)
        apply_context_parallel([model], settings, SEQ)
        tb = split_token_batch(_batch(packed), settings.split(SEQ), cp.rank, balance=zigzag)
        loss = _forward(model, tb)
        loss.backward()
        grads = full_grads(model, mesh.info("tp")) if tp > 1 else {
            n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for g in grads.values():  # what the data-parallel reduction over dp x cp does: the mean over cp
            dist.all_reduce(g, group=cp.group)
            g.div_(cp.size)
        with torch.no_grad(), whole_sequences([model]):  # generation: a whole prompt on every rank
            logits = model(_batch(False).input_ids[0, :, :6])
        out.append((loss.detach(), grads, logits))
    return out


def _check(world, tp, cases):
    results = run_distributed(_worker, world, tp, cases)
    for i, (mode, packed, zigzag) in enumerate(cases):
        ref_loss, ref_grads, ref_logits = _reference(packed)
        for rank, per_case in enumerate(results):
            loss, grads, logits = per_case[i]
            torch.testing.assert_close(logits, ref_logits, rtol=TOL, atol=TOL)
            where = f"{mode} packed={packed} zigzag={zigzag} rank {rank}"
            torch.testing.assert_close(loss, ref_loss, rtol=TOL, atol=TOL, msg=where)
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], rtol=TOL, atol=TOL, msg=f"{where}: {name}")


def test_split_batch_shifts_labels_on_the_whole_row_first():
    tb = _batch(packed=True)
    assert tb.labels is not None and tb.segment_ids is not None
    for split in (SequenceSplit(SEQ, 2), balanced_split(tb.segment_ids[0], 2)):
        parts = [split_token_batch(tb, split, r, balance=False) for r in range(2)]
        targets = split.unsplit([p.labels for p in parts])
        assert torch.equal(targets, shifted_targets(tb.labels))
        assert targets[0, 0, 4].item() == -100  # the token before document 1 predicts nothing
        assert torch.equal(split.unsplit([p.position_ids for p in parts]), tb.position_ids)
        docs, chunks = zip(*(decode_chunks(p.segment_ids, 2) for p in parts), strict=True)
        assert torch.equal(split.unsplit(list(docs)), tb.segment_ids)
        assert [tuple(c[0, 0, ::6].tolist()) for c in chunks] == [split.chunks(r) for r in range(2)]
    balanced = [split_token_batch(tb, SequenceSplit(SEQ, 2), r) for r in range(2)]  # balance=True: the same
    assert all(torch.equal(a.segment_ids, b.segment_ids) for a, b in zip(balanced, parts, strict=True))
    plain = split_token_batch(_batch(packed=False), SequenceSplit(SEQ, 2), 1)
    assert plain.position_ids is not None and plain.position_ids[0, 0].tolist() == list(range(6, 18))


def test_model_on_two_cp_ranks_equals_one_process():
    _check(2, 1, [("ring", True, True)])  # packed rows: causal, document masks and the loss over cp


@pytest.mark.slow
def test_model_on_two_cp_ranks_plain_allgather_and_contiguous_equal_one_process():
    _check(2, 1, [("ring", False, True), ("allgather", True, True), ("ring", True, False)])


@pytest.mark.slow
def test_model_at_cp2_tp2_with_sequence_parallelism_equals_one_process():
    _check(4, 2, [("ring", False, True), ("ring", True, True)])


# ------------------------------------------------------------------ recipes refused before start
def _problems(overrides: list[str], world: int) -> dict[str, str]:
    from plait.config import RecipeError, check_recipe

    with pytest.raises(RecipeError) as info:
        check_recipe(None, overrides, world)
    return {p.field: f"{p.value} — {p.valid}" for p in info.value.problems}


def test_bad_context_parallel_recipes_name_the_field_value_and_fix():
    ok = ["train.sample_tokens=0"]
    got = _problems(ok + ["parallel.cp=2", "data.seq_len=30"], 2)
    assert "data.seq_len" in got and "2*parallel.cp = 4" in got["data.seq_len"]
    assert "use 28 or 32" in got["data.seq_len"]
    got = _problems(ok + ["parallel.cp=3", "data.seq_len=48"], 4)
    assert "parallel.cp" in got and "cp values that do: [1, 2, 4]" in got["parallel.cp"]
    got = _problems(ok + ["parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "data.seq_len=44"], 8)
    assert "parallel.sequence_parallel" in got and "multiple of 16" in got["parallel.sequence_parallel"]
    got = _problems(["parallel.cp=2", "model.attention_dropout=0.1", "train.objective=dpo", "data.format=preference",
                     "data.seq_len=64"], 2)
    assert {"model.attention_dropout", "train.objective"} <= set(got)
    assert "must be 0 with parallel.cp=2" in got["model.attention_dropout"]
    got = _problems(ok + ["parallel.cp=2", "model.family=mistral", "model.sliding_window=16", "data.seq_len=64"], 2)
    assert "model.sliding_window" in got


def test_a_good_context_parallel_recipe_derives_dp_over_tp_pp_cp():
    from plait.config import check_recipe

    resolved = check_recipe(None, ["train.sample_tokens=0", "parallel.cp=2", "parallel.tp=2", "data.seq_len=64"], 8)
    assert resolved.dp == 2


def test_dp_cp_group_holds_the_parameter_replicas():
    from plait.mesh import ParallelMesh

    mesh = ParallelMesh(8, 0, tp=2, cp=2, create_groups=False)
    assert mesh.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for kw in ({"tp": 2}, {"tp": 2, "pp": 2}, {"pp": 2}):  # cp=1: exactly the dp groups, in their order
        mesh = ParallelMesh(8, 0, create_groups=False, **kw)
        assert mesh.group_ranks("dp_cp") == mesh.group_ranks("dp")


# ------------------------------------------------------------------ the planner knows cp
def test_planner_prices_context_parallelism():
    from plait.models.llama import LlamaConfig
    from plait.plan.degrees import ParallelDegrees
    from plait.plan.memory import estimate_memory
    from plait.plan.search import enumerate_layouts
    from plait.plan.timing import rank_flops

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536)
    one, two = ParallelDegrees(tp=2, dp=2, zero=1), ParallelDegrees(tp=2, cp=2, zero=1)
    assert (one.world, two.world, two.short()) == (4, 4, "tp2 pp1 dp1 cp2 zero1")
    kw = dict(precision="bf16-mixed", micro_batch_size=1, seq_len=32768, microbatches=1)
    m1, m2 = estimate_memory(cfg, one, **kw), estimate_memory(cfg, two, **kw)
    assert m2.optimizer == m1.optimizer  # ZeRO-1 shards over dp x cp = 2 ranks in both
    assert 0.45 < m2.activations / m1.activations < 0.55  # half the sequence per rank
    ring = 5 * 2 * 1 * 16384 * (cfg.num_key_value_heads // 2 * cfg.head_dim) * 4
    assert m2.comm_buffers == m1.comm_buffers + ring  # the ring's blocks in flight
    f1 = rank_flops(cfg, one, 32768, 1, 1, 0)
    assert rank_flops(cfg, two, 32768, 1, 1, 0) == pytest.approx(f1 / 2)
    long = {lay.cp for lay in enumerate_layouts(cfg, 16, seq_len=32768, global_batch_size=16)}
    short = {lay.cp for lay in enumerate_layouts(cfg, 16, seq_len=4096, global_batch_size=16)}
    assert long == {1, 2, 4, 8, 16} and short == {1}


def test_the_128k_recipe_validates_on_64_ranks():
    from pathlib import Path

    from plait.config import check_recipe

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "llama3-8b-128k.yaml"
    resolved = check_recipe(str(recipe), [], 64, check_paths=False)
    assert (resolved.recipe.parallel.cp, resolved.dp, resolved.recipe.data.seq_len) == (16, 1, 131072)
