"""MoE training through plait's one training path: the aux and z-losses under gradient
accumulation and pipeline parallelism, the recipe rules, and a run through the trainer.

The reference is written out by hand in one process: for each micro-batch, the next-token loss
plus ``coef * mean over MoE layers`` of the layer's load-balancing loss (and z-loss), averaged
over micro-batches, differentiated by autograd. The runtime instead never sees the MoE losses:
each layer adds their gradients in its own backward with the weights :func:`configure_moe` set,
so equal gradients prove the normalisation (micro-batches, layer count, a stage that holds only
some of the layers) is right.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from distributed import run_distributed
from plait.activation_checkpointing import apply_activation_checkpointing
from plait.config import RecipeError, load_recipe_text, validate_recipe
from plait.data.batch import TokenBatch
from plait.materialize import build_model, build_stages
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.mixtral import MixtralConfig
from plait.moe import MoeSection, configure_moe, moe_layers, read_moe_stats
from plait.nn.moe import load_balancing_loss, router_z_loss
from plait.pipeline.runtime import PipelineRuntime

TOL = 1e-5
AUX, Z = 0.3, 0.05  # large, so a mis-scaled loss gradient would show
MB, SEQ = 2, 8


def _config() -> MixtralConfig:
    return MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=32, tie_word_embeddings=False)


def _batch() -> torch.Tensor:
    return torch.randint(0, 64, (3, MB, SEQ), generator=torch.Generator().manual_seed(7))  # 3 micro-batches


def _reference() -> dict[str, torch.Tensor]:
    model = build_model(_config(), single_process_mesh(), seed=5)
    routings = []
    for _, layer in moe_layers([model]):
        layer.gate.register_forward_hook(lambda m, a, out: routings.append(out))
    batch = _batch()
    for ids in batch:
        routings.clear()
        loss = model(ids, ids)
        aux = torch.stack([load_balancing_loss(r.probs, r.experts) for r in routings]).mean()
        z = torch.stack([router_z_loss(r.logits) for r in routings]).mean()
        ((loss + AUX * aux + Z * z) / len(batch)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _runtime(stages, mesh) -> PipelineRuntime:
    configure_moe(stages, MoeSection(aux_loss_coef=AUX, z_loss_coef=Z), _config(), microbatches=3)
    return PipelineRuntime(stages, mesh, schedule="1f1b", microbatches=3, micro_batch_size=MB, seq_len=SEQ,
                           hidden_size=32, sequence_parallel=False, dtype=torch.float32)


def _max_diff(grads: dict, ref: dict) -> float:
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    return max((grads[n] - ref[n]).abs().max().item() for n in ref)


def test_gradient_accumulation_adds_the_scaled_losses_once():
    (stage,) = build_stages(_config(), single_process_mesh(), [[0, 1]], seed=5)
    runtime = _runtime([stage], single_process_mesh())
    runtime.run(TokenBatch(input_ids=_batch(), labels=_batch()), train=True)
    grads = {n: p.grad for n, p in stage.named_parameters()}
    ref = _reference()
    assert _max_diff(grads, ref) <= TOL
    router = "model.layers.0.block_sparse_moe.gate.weight"
    for _, layer in moe_layers([stage]):  # negative control: without the losses the routers' gradients differ
        layer.aux_loss_scale = layer.z_loss_scale = 0.0
    stage.zero_grad()
    runtime.run(TokenBatch(input_ids=_batch(), labels=_batch()), train=True)
    assert (stage.get_parameter(router).grad - ref[router]).abs().max() > 1e-4


def test_checkpointed_recomputation_is_not_counted_in_the_load_statistics():
    (stage,) = build_stages(_config(), single_process_mesh(), [[0, 1]], seed=5)
    runtime = _runtime([stage], single_process_mesh())
    apply_activation_checkpointing([stage], "full")
    with set_checkpoint_early_stop(False):  # the recomputation runs the whole layer, its statistics included
        runtime.run(TokenBatch(input_ids=_batch(), labels=_batch()), train=True)
    for _, layer in moe_layers([stage]):
        assert layer.stats is not None and layer.stats.forwards == 3, "one count per micro-batch forward"
        assert int(layer.stats.routed.sum()) == 3 * MB * SEQ * 2  # micro-batches x tokens x top-k


def _pp_worker(rank: int, world: int) -> dict:
    mesh = ParallelMesh(world, rank, pp=world)
    stages = build_stages(_config(), mesh, [[0], [1]], seed=5)
    _runtime(stages, mesh).run(TokenBatch(input_ids=_batch(), labels=_batch()), train=True)
    return {n: p.grad.clone() for stage in stages for n, p in stage.named_parameters()}


@pytest.mark.slow  # ~4 s: two processes
def test_pipeline_stages_each_add_their_layers_losses():
    results = run_distributed(_pp_worker, 2)
    assert _max_diff({n: g for r in results for n, g in r.items()}, _reference()) <= TOL


# ------------------------------------------------------------------------------------ recipe rules
MIXTRAL = """
model:
  family: mixtral
  hidden_size: 64
  intermediate_size: 32
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  num_local_experts: 4
  num_experts_per_tok: 2
"""


def _problems(text: str, world: int = 1) -> dict[str, str]:
    with pytest.raises(RecipeError) as e:
        validate_recipe(load_recipe_text(text), world, check_paths=False)
    return {p.field: str(p) for p in e.value.problems}


def test_a_valid_moe_recipe_and_the_shipped_one_pass():
    validate_recipe(load_recipe_text(MIXTRAL + "moe:\n  capacity_factor: 1.25\n"), 1, check_paths=False)
    validate_recipe(load_recipe_text(MIXTRAL + "parallel:\n  ep: 2\n  dp: 4\n  zero1: true\n"), 4,
                    check_paths=False)
    validate_recipe(load_recipe_text(MIXTRAL + "parallel:\n  tp: 2\n  sequence_parallel: true\n  ep: 2\n  dp: 2\n"),
                    4, check_paths=False)
    from plait.config.load import DEFAULT_RECIPE
    validate_recipe(load_recipe_text((DEFAULT_RECIPE.parent / "moe-tiny.yaml").read_text()), 2, check_paths=False)
    big = load_recipe_text((DEFAULT_RECIPE.parent / "mixtral-8x7b.yaml").read_text())
    resolved = validate_recipe(big, 64, check_paths=False)  # its 128-GPU overrides: tests/test_plan_moe.py
    assert resolved.dp == 8 and resolved.recipe.parallel.pp == 8


@pytest.mark.parametrize("text, field, words", [
    (MIXTRAL.replace("num_experts_per_tok: 2", "num_experts_per_tok: 5"), "model.num_experts_per_tok",
     "exceeds model.num_local_experts=4"),
    (MIXTRAL + "moe:\n  capacity_factor: 0\n", "moe.capacity_factor", "must be > 0"),
    (MIXTRAL + "parallel:\n  tp: 2\n  sequence_parallel: true\nmoe:\n  capacity_factor: 1.25\n",
     "moe.capacity_factor", "not available with parallel.sequence_parallel=true"),
    ("model:\n  num_local_experts: 8\n", "model.num_local_experts", "not a field of model.family='llama'"),
    ("moe:\n  aux_loss_coef: 0.01\n", "moe", "has no experts"),
    (MIXTRAL + "moe:\n  aux_loss_scope: global\n", "moe.aux_loss_scope", "micro_batch"),
    (MIXTRAL + "parallel:\n  ep: 3\n  dp: 3\n", "parallel.ep", "must divide the 4 experts of each MoE layer"),
    (MIXTRAL + "parallel:\n  ep: 4\n  dp: 2\n", "parallel.ep", "must divide the data-parallel degree dp=2"),
    ("parallel:\n  ep: 2\n  dp: 2\n", "parallel.ep", "has no experts to split"),
])
def test_bad_moe_recipes_are_refused_naming_the_field(text, field, words):
    world = 2 if "tp: 2" in text or "dp: 2" in text else 3 if "dp: 3" in text else 1
    problems = _problems(text, world=world)
    assert field in problems, problems
    assert words in problems[field], problems[field]


@pytest.mark.slow  # a subprocess (2-5 s); the rules themselves run in-process above
def test_bad_moe_recipe_is_refused_before_any_process_starts(tmp_path):
    cmd = [sys.executable, "-m", "plait.cli", "train", "model.family=mixtral", "model.num_local_experts=4",
           "model.num_experts_per_tok=6", "moe.capacity_factor=-1", f"run.output_dir={tmp_path / 'never'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "model.num_experts_per_tok" in proc.stderr and "moe.capacity_factor" in proc.stderr
    assert not (tmp_path / "never").exists()


# ------------------------------------------------------------------------------------ the trainer
TINY = ["model.family=mixtral", "model.hidden_size=64", "model.intermediate_size=32", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.num_local_experts=4",
        "model.num_experts_per_tok=2", "moe.aux_loss_coef=0.01", "moe.z_loss_coef=0.001", "parallel.tp=1",
        "parallel.sequence_parallel=false", "data.vocab_size=320", "data.seq_len=32", "data.micro_batch_size=4",
        "parallel.microbatches=2", "scheduler.warmup_steps=1", "train.sample_tokens=4"]


def _host_reads_worker(rank, world, recipe_yaml, prepared):
    from plait.train.trainer import Trainer
    from test_trainer import HostReadCounter

    trainer = Trainer(validate_recipe(load_recipe_text(recipe_yaml), world), prepared, rank, world)
    batches = iter(trainer.run.loader)
    counts = []
    for _ in range(3):
        batch = next(batches)
        with HostReadCounter() as counter:
            trainer.run_step(batch)
        counts.append(counter.count)
    layers = moe_layers(trainer.state.stages)
    trainer.run.loader.close()
    return counts, [layer.stats.forwards for _, layer in layers]


@pytest.mark.parametrize("layout", ["one-process", pytest.param("ep2", marks=pytest.mark.slow),
                                    pytest.param("ep2-exact", marks=pytest.mark.slow)])
def test_moe_steps_make_no_host_reads(tmp_path, layout):
    """No host read in a step; with ``moe.dispatch=exact`` exactly one per MoE layer and micro-batch
    forward (its split sizes), which also shows that the exact dispatcher is the one running."""
    from plait.config import load_recipe, recipe_to_yaml
    from plait.config.load import DEFAULT_RECIPE
    from plait.data.corpora import shakespeare_files
    from plait.train.entry import prepare_data

    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text(shakespeare_files()[0].read_text(encoding="latin-1")[:40000], encoding="utf-8")
    world = 1 if layout == "one-process" else 2
    extra = [] if world == 1 else ["parallel.dp=2", "parallel.ep=2"]
    exact = layout.endswith("exact")
    extra += ["moe.dispatch=exact"] if exact else []
    recipe = load_recipe(DEFAULT_RECIPE, TINY + extra + [f"data.source={src}", f"run.output_dir={tmp_path / 'run'}"])
    prepared = str(prepare_data(recipe))
    for counts, forwards in run_distributed(_host_reads_worker, world, recipe_to_yaml(recipe), prepared):
        assert counts == [2 * 2 if exact else 0] * 3, f"host reads per step {counts}"  # 2 layers x 2 micro-batches
        assert forwards == [6, 6], "each layer ran 2 micro-batches x 3 steps with its statistics on"


@pytest.mark.slow  # ~15 s: a whole two-process run through the command line
def test_plait_train_runs_an_moe_recipe_and_logs_expert_load(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    from plait.data.corpora import shakespeare_files
    (src / "a.txt").write_text(shakespeare_files()[0].read_text(encoding="latin-1")[:40000], encoding="utf-8")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "plait.cli", "train", *TINY, f"data.source={src}", f"run.output_dir={out}",
           "train.steps=4", "train.log_every=2", "train.eval_every=4", "train.eval_batches=1", "parallel.pp=2",
           "--nproc", "2"]  # layer 1 on the second rank: its metrics reach rank 0's log
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        for layer in ("layer0", "layer1"):
            assert r[f"moe/{layer}/imbalance"] >= 1.0 and r[f"moe/{layer}/dropped"] == 0.0
            assert r[f"moe/{layer}/aux_loss"] >= 1.0  # >= 1 for any routing with k=2 of 4 (balanced: 2)
    saved = json.loads((out / "final" / "config.json").read_text())
    assert saved["model_type"] == "mixtral" and saved["num_local_experts"] == 4
    loads = [json.loads(line) for line in (out / "moe_load.jsonl").read_text().splitlines()]
    assert [r["step"] for r in loads] == [2, 4] and set(loads[0]["layers"]) == {"layer0", "layer1"}
    assert all(abs(sum(row) - 1.0) < 1e-5 and len(row) == 4 for r in loads for row in r["layers"].values())
    assert (out / "moe_load.png").read_bytes().startswith(b"\x89PNG")


def test_load_map_keeps_a_resumed_steps_last_record_and_draws_a_png(tmp_path):
    from plait.moe.load_map import append_load, plot_load_map, read_load

    path = tmp_path / "moe_load.jsonl"
    append_load(path, 10, {"layer0": [0.5, 0.5], "layer1": [1.0, 0.0]})
    append_load(path, 20, {"layer0": [0.2, 0.8], "layer1": [0.6, 0.4]})
    append_load(path, 20, {"layer0": [0.3, 0.7], "layer1": [0.6, 0.4]})  # step 20 again, after a resume
    assert [r["layers"]["layer0"] for r in read_load(path)] == [[0.5, 0.5], [0.3, 0.7]]
    assert [r["step"] for r in read_load(path, last_step=10)] == [10]
    png = plot_load_map(path, tmp_path / "moe_load.png")
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")


# ------------------------------------------------------------------------------ logged statistics
def _stats_layer(routed: list[int], dropped: int = 0) -> list:
    """One Mixtral stage's first MoE layer with hand-set interval counters (two forwards)."""
    (stage,) = build_stages(_config(), single_process_mesh(), [[0, 1]], seed=5)
    configure_moe([stage], MoeSection(), _config(), microbatches=1)
    name, layer = moe_layers([stage])[0]
    layer.stats.routed += torch.tensor(routed, dtype=torch.float32)
    layer.stats.dropped += dropped
    layer.stats.aux += 2.5
    layer.stats.z += 0.5
    layer.stats.forwards = 2
    return [(name, layer)]


def test_logged_statistics_are_ratios_of_the_interval_sums():
    metrics, shares = read_moe_stats(_stats_layer([3, 1, 0, 0], dropped=1))
    assert metrics["moe/layer0/imbalance"] == pytest.approx(3 / 1.0)
    assert metrics["moe/layer0/dropped"] == pytest.approx(1 / 4)
    assert metrics["moe/layer0/aux_loss"] == pytest.approx(1.25) and metrics["moe/layer0/z_loss"] == pytest.approx(0.25)
    assert shares["layer0"] == pytest.approx([0.75, 0.25, 0.0, 0.0])
    assert "moe/layer0/bias_range" not in metrics  # a softmax router has no bias


def _two_rank_stats_worker(rank: int, world: int) -> tuple[dict, dict]:
    routed = [[3, 1, 0, 0], [0, 1, 2, 2]][rank]
    return read_moe_stats(_stats_layer(routed), None, world)


@pytest.mark.slow  # two processes
def test_ranks_add_their_counts_before_the_ratios():
    """Ranks that route different tokens (replicas, sequence-parallel shards) add their counts: the
    imbalance of [3, 1, 0, 0] + [0, 1, 2, 2] is 3 / 2.25, not the mean of the ranks' 3.0 and 2.0."""
    for metrics, shares in run_distributed(_two_rank_stats_worker, 2):
        assert metrics["moe/layer0/imbalance"] == pytest.approx(3 / 2.25)
        assert shares["layer0"] == pytest.approx([3 / 9, 2 / 9, 2 / 9, 2 / 9])
        assert metrics["moe/layer0/aux_loss"] == pytest.approx(1.25)
