"""Tracing a model into its chain of units and splitting the units into pipeline stages."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from plait.pipeline.partition import (
    Partition,
    PartitionError,
    balanced_partition,
    compress_names,
    even_partition,
    measure_unit_times,
    partition_model,
    unit_costs,
)
from plait.pipeline.trace import TraceError, Unit, llama_units, trace_units, trace_units_export


def _config(**kw):
    from plait.models.llama import LlamaConfig

    base = dict(vocab_size=77, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32)
    base.update(kw)
    return LlamaConfig(**base)


def _llama3_8b():
    return _config(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)


# ----------------------------------------------------------------------------------- tracing
def test_trace_plait_llama_gives_embedding_blocks_norm_head():
    from builders import build_llama
    from plait.mesh import single_process_mesh

    cfg = _config()
    units = trace_units(build_llama(cfg, single_process_mesh(), seed=0))
    assert [(u.name, u.kind) for u in units] == (
        [("model.embed_tokens", "embedding"), ("model.rotary_emb", "other")]
        + [(f"model.layers.{i}", "block") for i in range(4)]
        + [("model.norm", "norm"), ("lm_head", "head")])
    assert units[2].module_type == "LlamaDecoderLayer"
    assert units == llama_units(cfg)


def test_trace_needs_no_weights_and_export_agrees():
    from plait.models.llama import LlamaForCausalLM

    cfg = _config(tie_word_embeddings=True)
    with torch.device("meta"):  # fx traces symbolically: a meta model is enough
        assert trace_units(LlamaForCausalLM(cfg)) == llama_units(cfg)
    model = LlamaForCausalLM(cfg)
    assert trace_units_export(model, torch.randint(0, 77, (2, 8))) == llama_units(cfg)


def test_hf_llama_falls_back_to_torch_export():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(hf_cfg)
    ids = torch.randint(0, 64, (2, 8))
    try:  # transformers 5.x cannot be traced by torch.fx; older versions may be
        fx_units = trace_units(model)
    except TraceError as exc:
        assert "example_inputs" in str(exc) and "trace_units_export" in str(exc)
        fx_units = None
    units = trace_units(model, example_inputs=ids)
    assert [(u.name, u.kind) for u in units] == (
        [("model.embed_tokens", "embedding"), ("model.rotary_emb", "other")]
        + [(f"model.layers.{i}", "block") for i in range(3)]
        + [("model.norm", "norm"), ("lm_head", "head")])
    assert trace_units_export(model, ids) == units
    assert fx_units is None or fx_units == units


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow: fx cannot trace it
            return y
        return -y


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.ff = _Gate(), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.ff(self.gate(x))


class _Toy(nn.Module):
    def __init__(self, mode: str = "") -> None:
        super().__init__()
        self.mode = mode
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10)

    def forward(self, ids):
        h = e = self.emb(ids)
        prev = None
        for i, layer in enumerate(self.layers):
            out = layer(h)
            if self.mode == "skip" and i == 2:
                out = out + prev  # block 2 also reads block 0's output
            if self.mode == "glue":
                out = out * 0.5  # code between blocks belongs to no stage
            prev, h = h, out
        if self.mode == "reuse":
            h = self.layers[0](h)  # a block called twice cannot live on one stage
        h = self.norm(h)
        if self.mode == "embedding_skip":
            h = h + e
        return self.head(h)


def test_data_dependent_control_flow_names_code_and_leaf_types():
    with pytest.raises(TraceError) as info:
        trace_units(_Toy())
    msg = str(info.value)
    assert "control flow" in msg
    assert "if y.sum() > 0" in msg and "layers.0.gate" in msg
    assert "leaf_types=(_Gate,)" in msg and "leaf_types=(_Block,)" in msg
    for leaves in ((_Gate,), (_Block,)):
        units = trace_units(_Toy(), leaf_types=leaves)
        assert [u.kind for u in units] == ["embedding", "block", "block", "block", "norm", "head"]


@pytest.mark.parametrize("mode,needle", [
    ("skip", "before `layers.2`"), ("glue", "`mul` (in the enclosing forward)"), ("embedding_skip", "`emb` (in emb)")])
def test_graphs_that_are_not_chains_are_rejected(mode, needle):
    with pytest.raises(TraceError, match="not a chain") as info:
        trace_units(_Toy(mode), leaf_types=(_Block,))
    assert needle in str(info.value)


def test_block_called_twice_is_rejected():
    for leaves in ((_Block,), (_Gate,)):
        with pytest.raises(TraceError, match="layers.0 run more than once"):
            trace_units(_Toy("reuse"), leaf_types=leaves)

    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, ids):
            h = self.layers[1](self.layers[0](self.emb(ids)))
            return self.head(self.layers[0](h))

    with pytest.raises(TraceError, match="layers.0 run more than once"):
        trace_units(Reuse())
    with pytest.raises(TraceError, match="`layers.0` runs in more than one piece"):  # torch.export's view
        trace_units_export(Reuse(), torch.randint(0, 10, (2, 4)))


# ------------------------------------------------------------------------------------- costs
def test_unit_costs_params_and_flops():
    cfg = _config(vocab_size=1000)
    units = llama_units(cfg)
    params = unit_costs(cfg, units, kind="params")
    assert sum(params) == cfg.num_parameters()  # untied: every parameter counted once
    tied = _config(vocab_size=1000, tie_word_embeddings=True)
    assert sum(unit_costs(tied, units)) == tied.num_parameters() + 1000 * 48  # the tied head still runs
    flops = unit_costs(cfg, units, seq_len=16, kind="flops")
    block = params[2]
    assert flops[2] == 6 * block + 12 * 6 * 8 * 16
    assert (flops[0], flops[1], flops[-2], flops[-1]) == (0.0, 0.0, 0.0, 6 * 1000 * 48)
    with pytest.raises(PartitionError, match="seq_len=None"):
        unit_costs(cfg, units, kind="flops")
    with pytest.raises(PartitionError, match="'bytes' is not valid"):
        unit_costs(cfg, units, 16, kind="bytes")


def test_measure_unit_times_profiles_each_unit_without_touching_grads():
    from builders import build_llama
    from plait.mesh import single_process_mesh

    model = build_llama(_config(num_hidden_layers=2), single_process_mesh(), seed=0)
    units = trace_units(model)
    times = measure_unit_times(model, units, torch.randint(0, 77, (2, 16)), warmup=1, iters=2)
    assert len(times) == len(units) and all(t >= 0 for t in times)
    assert all(t > 0 for t, u in zip(times, units, strict=True) if u.kind == "block")
    assert all(p.grad is None for p in model.parameters())
    part = partition_model(units, times, 2, cost_kind="seconds")
    assert part.stage_layers() == [[0], [1]] and " ms" in part.describe()


# -------------------------------------------------------------------------------- algorithms
def _brute_force_bottleneck(costs, k):
    n = len(costs)
    best = float("inf")
    for cut in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cut, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_balanced_partition_is_exact_and_deterministic():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 9)
        costs = [rng.choice([0.0, 1.0, 2.5, rng.random() * 10]) for _ in range(n)]
        for k in range(1, n + 1):
            ranges = balanced_partition(costs, k)
            assert ranges[0][0] == 0 and ranges[-1][1] == n and len(ranges) == k
            assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in itertools.pairwise(ranges))
            got = max(sum(costs[a:b]) for a, b in ranges)
            assert got == pytest.approx(_brute_force_bottleneck(costs, k), rel=1e-12, abs=1e-12)
            assert balanced_partition(list(costs), k) == ranges
    # Uniform (or zero) costs reproduce the even split, remainder on the last stages as in NxD.
    assert balanced_partition([1.0] * 10, 4) == even_partition(10, 4) == [(0, 2), (2, 4), (4, 7), (7, 10)]
    assert balanced_partition([0.0] * 10, 4) == even_partition(10, 4)
    with pytest.raises(PartitionError, match="costs\\[1\\]=-1"):
        balanced_partition([1, -1], 2)


def test_every_block_in_exactly_one_nonempty_stage_in_order():
    for layers in range(1, 13):
        cfg = _config(num_hidden_layers=layers, vocab_size=3000)
        units = llama_units(cfg)
        names = [u.name for u in units]
        blocks = [u.name for u in units if u.kind == "block"]
        for stages in range(1, min(layers, 6) + 1):
            for method, kind in (("even", "params"), ("balanced", "params"), ("balanced", "flops")):
                costs = unit_costs(cfg, units, 64, kind)
                part = partition_model(units, costs, stages, method, cost_kind=kind)
                assert part.num_stages == stages
                assert [n for st in part.stages for n in st] == names  # each unit once, order kept
                for st in part.stages:
                    assert any(n in blocks for n in st), (layers, stages, method, part.stages)
                assert part.stages[0][0] == "model.embed_tokens" and part.stages[-1][-2:] == ["model.norm", "lm_head"]
                assert sum(part.costs) == pytest.approx(sum(costs))
                assert [i for ids in part.stage_layers() for i in ids] == list(range(layers))
                assert partition_model(units, costs, stages, "manual", part.cuts()).stages == part.stages
            even = partition_model(units, costs, stages, "even")
            best = partition_model(units, costs, stages, "balanced")
            assert max(best.costs) <= max(even.costs) + 1e-9


def test_more_stages_than_blocks_errors():
    units = llama_units(_config(num_hidden_layers=3))
    for method in ("even", "balanced"):
        with pytest.raises(PartitionError, match="more stages than blocks: num_stages=4 but the model has 3"):
            partition_model(units, None, 4, method)
    with pytest.raises(PartitionError, match="more stages than blocks"):
        partition_model(units, None, 4, "manual", ["model.layers.1", "model.layers.2", "lm_head"])
    with pytest.raises(PartitionError, match="more stages than blocks"):
        even_partition(3, 4)


def test_manual_cuts_and_their_errors():
    units = llama_units(_config(num_hidden_layers=12))
    part = partition_model(units, None, 3, "manual", ["model.layers.4", "model.layers.8"])
    assert part.stage_layers() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert part.stages[0][:2] == ["model.embed_tokens", "model.rotary_emb"]
    with pytest.raises(PartitionError) as info:
        partition_model(units, None, 3, "manual", ["model.layers.4", "model.layer.8"])
    msg = str(info.value)
    assert "'model.layer.8'" in msg and "valid cut names: model.layers.1, model.layers.2" in msg
    assert "model.layers.11" in msg and "model.layers.0," not in msg
    cases = [(["model.layers.4"], "num_stages=3 needs 2 cuts"),
             (["model.layers.4", "lm_head"], "'lm_head' is not a block"),
             (["model.layers.0", "model.layers.4"], "'model.layers.0' is the first block"),
             (["model.layers.8", "model.layers.4"], "must be in model order"),
             (["model.layers.4", "model.layers.4"], "must be in model order")]
    for cuts, needle in cases:
        with pytest.raises(PartitionError, match=needle):
            partition_model(units, None, 3, "manual", cuts)
    with pytest.raises(PartitionError, match="method='manual' needs cuts"):
        partition_model(units, None, 3, "manual")
    with pytest.raises(PartitionError, match="only used with method='manual'"):
        partition_model(units, None, 3, "balanced", ["model.layers.4", "model.layers.8"])
    with pytest.raises(PartitionError, match="method='greedy' is not valid"):
        partition_model(units, None, 3, "greedy")


@pytest.mark.parametrize("stages", [4, 8])
def test_large_vocabulary_gives_end_stages_fewer_blocks(stages):
    cfg = _llama3_8b()  # embedding and head are each ~2.4 blocks of parameters
    units = llama_units(cfg)
    costs = unit_costs(cfg, units, kind="params")
    even = partition_model(units, costs, stages, "even")
    best = partition_model(units, costs, stages, "balanced")
    even_layers, best_layers = even.stage_layers(), best.stage_layers()
    assert len(best_layers[0]) < len(even_layers[0]) and len(best_layers[-1]) < len(even_layers[-1])
    assert max(best.costs) < max(even.costs)
    # FLOPs: the embedding lookup is free but the head matmul is not, so only the last stage shrinks.
    flops = unit_costs(cfg, units, 8192, "flops")
    even_f = partition_model(units, flops, stages, "even")
    best_f = partition_model(units, flops, stages, "balanced")
    assert len(best_f.stage_layers()[-1]) < len(even_f.stage_layers()[-1])
    assert max(best_f.costs) < max(even_f.costs)


def test_describe_table():
    cfg = _llama3_8b()
    units = llama_units(cfg)
    part = partition_model(units, unit_costs(cfg, units), 8, "even", cost_kind="params")
    text = part.describe()
    lines = text.splitlines()
    assert lines[0].split() == ["stage", "units", "params", "share"]
    assert len(lines) == 1 + 8 + 1
    assert "model.embed_tokens, model.rotary_emb, layers 0-3" in lines[1] and lines[1].lstrip().startswith("0 ")
    assert "layers 28-31, model.norm, lm_head" in lines[8]
    assert "872M" in lines[2] and "10.9%" in lines[2]
    assert lines[-1].startswith("bottleneck: stage ") and "ideal 12.5% for 8 stages" in lines[-1]
    assert "method=even" in lines[-1]
    assert compress_names(["a", "x.layers.0", "x.layers.1", "x.layers.3", "b"]) == "a, layers 0-1, layers 3, b"
    assert isinstance(part, Partition) and part.stage_of("lm_head") == 7


def test_units_must_have_blocks_in_one_run():
    units = [Unit("emb", "embedding", "Embedding"), Unit("l.0", "block", "B"), Unit("mid", "other", "X"),
             Unit("l.1", "block", "B")]
    with pytest.raises(PartitionError, match="mid lie between the blocks"):
        partition_model(units, None, 2, "even")
    with pytest.raises(PartitionError, match="no block"):
        partition_model([Unit("emb", "embedding", "Embedding")], None, 1)
    with pytest.raises(PartitionError, match="got 1 costs for 2 units"):
        partition_model(units[:2], [1.0], 1)
