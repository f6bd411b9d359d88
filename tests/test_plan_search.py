"""Layout search (plait.plan.search), dry runs on a fake process group (plait.plan.dry_run) and
the ``plait plan`` command."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from plait.models.llama.config import LlamaConfig
from plait.plan.degrees import ParallelDegrees
from plait.plan.search import (
    PlanError,
    SearchOptions,
    default_global_batch,
    enumerate_layouts,
    rank_layouts,
)
from plait.tensor_parallel.heads import HeadLayout

RECIPES = Path(__file__).resolve().parent.parent / "src" / "plait" / "recipes"


def tiny(**kw) -> LlamaConfig:
    base = dict(vocab_size=250, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False)
    base.update(kw)
    return LlamaConfig(**base)


def recipe_config(name: str) -> LlamaConfig:
    from plait.commands.plan import load_plan_inputs

    return load_plan_inputs(str(RECIPES / name), [])[1]


# ------------------------------------------------------------------------------ enumeration
def test_every_listed_layout_is_valid():
    from plait.pipeline.schedules import validate_schedule

    c = tiny()
    world, per_node, seq, mbs = 8, 4, 64, 2
    layouts = enumerate_layouts(c, world, devices_per_node=per_node, micro_batch_size=mbs, seq_len=seq)
    assert len(layouts) == len(set(layouts)), "no layout is listed twice"
    g = default_global_batch(seq)
    for lay in layouts:
        assert lay.tp * lay.pp * lay.dp == world == lay.world
        assert per_node % lay.tp == 0, "TP stays within a node"
        HeadLayout.plan(c.num_attention_heads, c.num_key_value_heads, c.head_dim, lay.tp, lay.kv_replication)
        assert c.intermediate_size % lay.tp == 0
        assert lay.pp * lay.vpp <= c.num_hidden_layers
        assert lay.sequence_parallel == (lay.tp > 1)
        assert not lay.zero or lay.dp > 1
        assert lay.activation_checkpointing in ("none", "full")
        m = g // (lay.dp * mbs)
        assert m * lay.dp * mbs == g
        if lay.pp > 1:
            validate_schedule(lay.schedule, lay.pp, m, lay.vpp)
            assert (lay.vpp == 2) == (lay.schedule == "interleaved-1f1b")
        else:
            assert lay.vpp == 1
    degrees = {(lay.tp, lay.pp, lay.dp) for lay in layouts}
    assert degrees == {(t, p, 8 // (t * p)) for t in (1, 2, 4) for p in (1, 2, 4) if 8 % (t * p) == 0}
    # every valid KV replication factor at tp=4 (8 heads, 4 KV heads: 1 or 2), ZeRO-1 both ways
    assert {lay.kv_replication for lay in layouts if lay.tp == 4} == {1, 2}
    assert {lay.zero for lay in layouts if lay.dp > 1} == {0, 1, 2, 3}
    assert {lay.vpp for lay in layouts if lay.pp == 2} == {1, 2}


def test_microbatch_rule_and_interleaving():
    c = tiny(num_hidden_layers=8)
    # fixed micro-batches: 3 is not a multiple of pp=2, so no interleaved layout at pp=2
    layouts = enumerate_layouts(c, 4, devices_per_node=1, seq_len=64, microbatches=3)
    assert {(lay.pp, lay.vpp) for lay in layouts} == {(1, 1), (2, 1), (4, 1)}
    layouts = enumerate_layouts(c, 4, devices_per_node=1, seq_len=64, microbatches=4)
    assert {(lay.pp, lay.vpp) for lay in layouts} == {(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)}
    # a fixed global batch of 6 sequences: dp=4 does not divide it
    layouts = enumerate_layouts(c, 4, devices_per_node=1, seq_len=64, global_batch_size=6)
    assert {lay.dp for lay in layouts} == {1, 2}
    only_auto = enumerate_layouts(c, 4, devices_per_node=4, seq_len=64,
                                  options=SearchOptions(all_kv_replications=False, try_zero1=False,
                                                        activation_checkpointing=("none",), max_vpp=1))
    assert len(only_auto) == len({(lay.tp, lay.pp) for lay in only_auto})


def test_llama3_degrees_stay_within_a_node():
    c = recipe_config("llama3-8b.yaml")
    layouts = enumerate_layouts(c, 64, devices_per_node=8, seq_len=8192)
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}
    assert all(lay.pp <= 32 for lay in layouts)
    assert ParallelDegrees(tp=8, pp=1, dp=8, sequence_parallel=True, zero=1, schedule="1f1b") in layouts


@pytest.mark.parametrize("method,cost", [("balanced", "flops"), ("balanced", "params"), ("even", "flops")])
@pytest.mark.parametrize("stages", [2, 3, 8])
def test_fast_stage_split_equals_the_traced_partition(stages, method, cost):
    from plait.plan.pipeline_split import plan_partition
    from plait.plan.search import stage_split

    for c in (tiny(num_hidden_layers=8), tiny(num_hidden_layers=9, tie_word_embeddings=True, vocab_size=4000)):
        assert (stage_split(c, stages, 64, method=method, cost=cost)
                == plan_partition(c, stages, 64, method=method, cost=cost).stage_layers())


# ------------------------------------------------------------------------------ ranking
def test_recommendation_is_the_fastest_layout_that_fits():
    c = recipe_config("llama3-8b.yaml")
    plan = rank_layouts(c, 8, "h100", devices_per_node=8, seq_len=8192, micro_batch_size=1, precision="autocast")
    rec = plan.recommended
    assert rec is not None and rec.fits and rec.memory.total <= plan.budget_bytes
    assert plan.budget_bytes == int(80e9 * 0.9)
    fitting = [cand for cand in plan.candidates if cand.fits]
    assert rec is fitting[0]
    assert all(cand.time.total_s >= rec.time.total_s * (1 - 1e-9) for cand in fitting)
    times = [cand.seconds_per_sequence for cand in plan.candidates]
    assert times == sorted(times)
    for cand in plan.candidates:
        assert cand.fits == (cand.memory.total <= plan.budget_bytes)
        assert cand.global_batch_size == default_global_batch(8192)


def test_bad_world_names_the_world_and_why():
    c = tiny(num_hidden_layers=4)
    with pytest.raises(PlanError) as e:
        enumerate_layouts(c, 13, devices_per_node=8, seq_len=64)
    msg = str(e.value)
    assert "world 13" in msg and "4 decoder layers" in msg and "does not divide the global batch" in msg
    with pytest.raises(PlanError, match="world 13"):
        rank_layouts(c, 13, "h100", seq_len=64)
    # an MLP width no TP degree > 1 divides, 2 layers and a global batch of 1 sequence: world 4 has nothing
    with pytest.raises(PlanError, match="world 4 has no valid layout") as e:
        enumerate_layouts(tiny(intermediate_size=97, num_hidden_layers=2), 4, devices_per_node=4, seq_len=64,
                          global_batch_size=1)
    msg = str(e.value)
    assert "tp=2 does not divide intermediate_size=97" in msg and "pp=4 (tp=1) exceeds the 2 decoder layers" in msg


def test_tiny_budget_states_the_smallest_budget_that_fits():
    c = tiny()
    with pytest.raises(PlanError) as e:
        rank_layouts(c, 8, "h100", devices_per_node=8, seq_len=64, memory_bytes=10_000)
    err = e.value
    smallest = min(cand.memory.total for cand in err.plan.candidates)
    need_gb = smallest / 0.9 / 1e9
    assert "no layout of world 8 fits" in str(err)
    assert f"{-(-need_gb * 10 // 1) / 10:.1f} GB" in str(err)
    # that budget is indeed enough
    plan = rank_layouts(c, 8, "h100", devices_per_node=8, seq_len=64, memory_bytes=int(smallest / 0.9) + 1)
    assert plan.recommended is not None and plan.recommended.memory.total == smallest


def test_unknown_device_lists_the_valid_names():
    with pytest.raises(PlanError, match=r"'h1000'.*valid: .*'h100'.*'trn1'"):
        rank_layouts(tiny(), 8, "h1000", seq_len=64)


# ------------------------------------------------------------------------------ dry run
@pytest.mark.parametrize("cfg_kw", [{}, {"tie_word_embeddings": True}, {"vocab_size": 255}])
@pytest.mark.parametrize("layout", [
    ParallelDegrees(tp=2, pp=2, dp=2, sequence_parallel=True, zero=1),
    ParallelDegrees(tp=4, pp=2, dp=1, vpp=2, kv_replication=2, sequence_parallel=True, schedule="interleaved-1f1b"),
    ParallelDegrees(tp=8, pp=1, dp=1, kv_replication=2, sequence_parallel=True),
    ParallelDegrees(tp=1, pp=4, dp=2, schedule="1f1b", activation_checkpointing="full"),
])
def test_dry_run_parameter_bytes_equal_the_estimate(layout, cfg_kw):
    from plait.plan.dry_run import dry_run
    from plait.plan.memory import estimate_memory

    c = tiny(num_hidden_layers=8, **cfg_kw)
    for rank in sorted({0, 3, 7}):
        report = dry_run(c, layout, 8, rank, precision="autocast", micro_batch_size=1, seq_len=64, microbatches=4)
        est = estimate_memory(c, layout, precision="autocast", micro_batch_size=1, seq_len=64, microbatches=4,
                              stage=report.coords["pp"])
        assert report.estimated_param_bytes == est.parameters
        assert report.matches, report.check_line()
        assert report.group_sizes["tp"] == layout.tp and report.group_sizes["pp"] == layout.pp
    import torch.distributed as dist

    assert not dist.is_initialized(), "the fake process group is destroyed"


def test_dry_run_covers_the_whole_model_once():
    """Over all pipeline ranks of one TP rank, without padding, the dry run holds every parameter of the
    model once, each split over tp (replicated norms excepted)."""
    from plait.plan.dry_run import dry_run

    c = tiny(num_hidden_layers=6)
    layout = ParallelDegrees(tp=1, pp=4, dp=2)
    total = sum(dry_run(c, layout, 8, r, seq_len=64, microbatches=4).param_count for r in (0, 2, 4, 6))
    assert total == c.num_parameters()


def test_dry_run_rejects_bad_input():
    from plait.plan.dry_run import dry_run

    with pytest.raises(PlanError, match="not the world 16"):
        dry_run(tiny(), ParallelDegrees(tp=2, pp=2, dp=2), 16, 0, seq_len=64)
    with pytest.raises(PlanError, match="rank=8 is outside"):
        dry_run(tiny(), ParallelDegrees(tp=2, pp=2, dp=2), 8, 8, seq_len=64)


def test_dry_run_llama3_8b_world_64_is_fast():
    from plait.plan.dry_run import dry_run

    c = recipe_config("llama3-8b.yaml")
    layout = ParallelDegrees(tp=8, pp=4, dp=2, vpp=2, sequence_parallel=True, zero=1, schedule="interleaved-1f1b")
    start = time.perf_counter()
    reports = [dry_run(c, layout, 64, r, precision="autocast", seq_len=8192, microbatches=8) for r in (0, 63)]
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"dry run of Llama-3 8B at world 64 took {elapsed:.1f} s"
    for report in reports:
        assert report.matches, report.check_line()
    assert reports[0].coords == {"pp": 0, "dp": 0, "tp": 0}
    assert reports[1].coords == {"pp": 3, "dp": 1, "tp": 7}
    assert reports[0].stages[0][2] and reports[1].stages[-1][3], "embedding on rank 0, head on the last rank"


# ------------------------------------------------------------------------------ command
def test_plan_command_prints_table_and_recommendation(capsys):
    from plait.cli import main

    assert main(["plan", str(RECIPES / "llama3-8b.yaml"), "--world", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "recipe overrides: parallel.tp=" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("#"))
    for col in ("layout", "params", "grads", "optim", "act", "total GiB", "step s", "MFU", "fits"):
        assert col in header
    assert "yes *" in out
    assert main(["plan", str(RECIPES / "llama3-8b.yaml"), "--world", "8", "--no-zero1", "--no-checkpointing",
                 "--all"]) == 0
    out = capsys.readouterr().out
    assert "zero1" not in out.replace("parallel.zero1=false", "") and "ckpt-full" not in out


@pytest.mark.parametrize("recipe,argv,needle", [
    ("llama3-8b.yaml", ["--world", "8", "--device", "h1000"], "valid: "),
    ("llama3-8b.yaml", ["--world", "8", "--memory", "0.001"], "smallest device memory that would fit is"),
    ("default.yaml", ["--world", "13", "--nodes-of", "8"], "world 13 has no valid layout"),
    ("llama3-8b.yaml", ["--world", "8", "model.num_hidden_layers=0"], "model.num_hidden_layers"),
    ("llama3-8b.yaml", ["--world", "8", "--precision", "fp8"], "precision='fp8' is not valid"),
    ("llama3-8b.yaml", ["--world", "0"], "--world=0 must be a positive integer"),
])
def test_plan_command_errors_are_one_line(capsys, recipe, argv, needle):
    from plait.cli import main

    assert main(["plan", str(RECIPES / recipe), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_plan_command_dry_run_tiny(capsys):
    from plait.cli import main

    code = main(["plan", str(RECIPES / "default.yaml"), "--world", "8", "--nodes-of", "4", "--dry-run",
                 "--rank", "5"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "rank 5 (" in out and "dry run: parameter (and sharded state) bytes match the memory model" in out


def test_moe_layouts_are_only_those_moe_runs():
    """Mixtral: sequence parallelism only with tp > 1, and none when the search is told the recipe
    sets a capacity factor (plait refuses it with SP); dp always a multiple of the recipe's
    parallel.ep (expert parallelism folds over data parallelism)."""
    from plait.plan.search import SearchOptions, enumerate_layouts

    config = recipe_config("mixtral-8x7b.yaml")
    layouts = enumerate_layouts(config, 64, seq_len=4096, options=SearchOptions(expert_parallel=8))
    assert layouts
    assert all(layout.tp > 1 for layout in layouts if layout.sequence_parallel)
    capacity = enumerate_layouts(config, 64, seq_len=4096,
                                 options=SearchOptions(expert_parallel=8, moe_sequence_parallel=False))
    assert capacity and not any(layout.sequence_parallel for layout in capacity)
    assert all(layout.dp % 8 == 0 for layout in layouts)
