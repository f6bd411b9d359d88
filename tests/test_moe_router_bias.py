"""The sigmoid router with an auxiliary-loss-free expert bias (DeepSeek-V3 style) in training:
the recipe knobs, the bias update after each step against a hand reference from the recorded
expert counts, data parallelism against one process, and a resume that continues the biases.

Hand reference: with ``load`` the step's assignments per expert (recorded by hooks on the routers,
summed over the step's micro-batches and, with data parallelism, over the replicas),
``bias += rate * sign(mean(load) - load)`` after every step, starting from zero.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from distributed import run_distributed
from plait.config import RecipeError, load_recipe_text, validate_recipe
from plait.data.batch import TokenBatch
from plait.materialize import build_stages
from plait.mesh import single_process_mesh
from plait.models.mixtral import MixtralConfig
from plait.moe import MoeSection, configure_moe, moe_layers, read_moe_stats
from plait.moe.step_load import attach_load_balancing
from plait.nn.moe import SigmoidTopKRouter, assignments_per_expert
from plait.pipeline.runtime import PipelineRuntime
from test_moe_training import MIXTRAL  # the tiny Mixtral recipe the MoE rule tests share
from trainer_runs import corpus_dir, max_relative

RATE = 0.01
E = 4


def _config() -> MixtralConfig:
    return MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=2,
                         max_position_embeddings=32, tie_word_embeddings=False)


def _record_loads(layers) -> list[list[torch.Tensor]]:
    """Per layer, the counts of each training forward (evaluation forwards run without gradients)."""
    loads: list[list[torch.Tensor]] = [[] for _ in layers]
    for i, (_, layer) in enumerate(layers):
        def hook(module, args, out, i=i):
            if torch.is_grad_enabled():
                loads[i].append(assignments_per_expert(out.experts, E).clone())
        layer.gate.register_forward_hook(hook)
    return loads


def _reference_bias(step_loads: list[torch.Tensor]) -> torch.Tensor:
    bias = torch.zeros(E)
    for load in step_loads:
        load = load.float()
        bias += RATE * torch.sign(load.mean() - load)
    return bias


# ------------------------------------------------------------------------------ the layer's router
def test_sigmoid_router_replaces_the_softmax_one_over_the_same_weight():
    (stage,) = build_stages(_config(), single_process_mesh(), [[0, 1]], seed=5)
    weights = {n: p for n, p in stage.named_parameters()}
    configure_moe([stage], MoeSection(router="sigmoid", router_groups=2, router_topk_groups=1), _config(),
                  microbatches=1)
    assert {n: p for n, p in stage.named_parameters()} == weights, "same names, same parameter objects"
    for name, layer in moe_layers([stage]):
        gate = layer.gate
        assert isinstance(gate, SigmoidTopKRouter) and gate.weight is weights[f"{name}.gate.weight"]
        assert (gate.num_groups, gate.topk_groups, gate.renormalize) == (2, 1, True)
        assert torch.equal(gate.expert_bias, torch.zeros(E))


def test_bias_follows_the_recorded_step_loads():
    """3 steps of 2 micro-batches: each step's bias update uses that step's summed counts (the
    routing itself depends on the bias, so a late or partial update would change the counts)."""
    (stage,) = build_stages(_config(), single_process_mesh(), [[0, 1]], seed=5)
    section = MoeSection(router="sigmoid", router_bias_update_rate=RATE, aux_loss_coef=0.0)
    configure_moe([stage], section, _config(), microbatches=2)
    hooks = attach_load_balancing([stage], section, None, microbatches=2)
    assert hooks is not None
    layers = moe_layers([stage])
    loads = _record_loads(layers)
    runtime = PipelineRuntime([stage], single_process_mesh(), schedule="1f1b", microbatches=2, micro_batch_size=2,
                              seq_len=8, hidden_size=32, sequence_parallel=False, dtype=torch.float32)
    batch = torch.randint(0, 12, (2, 2, 8), generator=torch.Generator().manual_seed(1))
    steps = 3
    for _ in range(steps):
        hooks.start_step()
        runtime.run(TokenBatch(input_ids=batch, labels=batch), train=True)
        hooks.finish_step(torch.tensor(1.0))
    for (_, layer), forwards in zip(layers, loads, strict=True):
        assert len(forwards) == 2 * steps
        per_step = [forwards[2 * s] + forwards[2 * s + 1] for s in range(steps)]
        assert torch.allclose(layer.gate.expert_bias, _reference_bias(per_step), atol=1e-7)
        assert layer.gate.expert_bias.abs().sum() > 0
    metrics, _ = read_moe_stats(layers)  # the logged spread of each layer's bias
    for name, layer in layers:
        short = name.replace("model.layers.", "layer").split(".")[0]
        bias = layer.gate.expert_bias
        assert metrics[f"moe/{short}/bias_range"] == pytest.approx(float(bias.max() - bias.min()))
    before = [layer.gate.expert_bias.clone() for _, layer in layers]
    hooks.start_step()
    runtime.run(TokenBatch(input_ids=batch, labels=batch), train=True)
    hooks.finish_step(torch.tensor(float("inf")))  # a step with a non-finite gradient norm moves no bias
    assert all(torch.equal(b, layer.gate.expert_bias) for b, (_, layer) in zip(before, layers, strict=True))


# ------------------------------------------------------------------------------ recipe rules
def test_a_sigmoid_recipe_passes():
    validate_recipe(load_recipe_text(MIXTRAL + "moe:\n  router: sigmoid\n  router_bias_update_rate: 0.01\n"
                                               "  router_groups: 2\n  router_topk_groups: 1\n"
                                               "  aux_loss_scope: global_batch\n"), 1, check_paths=False)


@pytest.mark.parametrize("moe, field, words", [
    ("router: relu", "moe.router", "sigmoid"),
    ("router_bias_update_rate: 0.01", "moe.router_bias_update_rate", "only the sigmoid router"),
    ("router: softmax\n  router_groups: 2", "moe.router_groups", "only the sigmoid router"),
    ("router: sigmoid\n  router_bias_update_rate: -1", "moe.router_bias_update_rate", ">= 0"),
    ("router: sigmoid\n  router_groups: 3", "moe.router_groups", "must divide the 4 experts"),
    ("router: sigmoid\n  router_groups: 2\n  router_topk_groups: 3", "moe.router_topk_groups",
     "must be <= moe.router_groups=2"),
    ("router: sigmoid\n  router_groups: 4\n  router_topk_groups: 1", "moe.router_topk_groups",
     "fewer than model.num_experts_per_tok=2"),
    ("aux_loss_scope: global", "moe.aux_loss_scope", "global_batch"),
])
def test_bad_router_knobs_are_refused_naming_the_field(moe, field, words):
    with pytest.raises(RecipeError) as e:
        validate_recipe(load_recipe_text(MIXTRAL + "moe:\n  " + moe + "\n"), 1, check_paths=False)
    problems = {p.field: str(p) for p in e.value.problems}
    assert field in problems, problems
    assert words in problems[field], problems[field]


def test_router_keys_on_a_dense_family_are_refused():
    with pytest.raises(RecipeError) as e:
        validate_recipe(load_recipe_text("moe:\n  router: sigmoid\n"), 1, check_paths=False)
    problems = {p.field: str(p) for p in e.value.problems}
    assert "moe.router" in problems.get("moe", ""), problems


# ------------------------------------------------------------------------------ through the trainer
TINY = ["model.family=mixtral", "model.hidden_size=64", "model.intermediate_size=32", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.num_local_experts=4",
        "model.num_experts_per_tok=2", "model.tie_word_embeddings=false", "moe.router=sigmoid",
        f"moe.router_bias_update_rate={RATE}", "moe.aux_loss_coef=0.01", "moe.aux_loss_scope=global_batch",
        "parallel.tp=1", "parallel.sequence_parallel=false", "data.vocab_size=320", "data.seq_len=32",
        "scheduler.warmup_steps=1", "optimizer.lr=1.5e-3", "train.sample_tokens=0", "logging.progress_bar=false",
        "logging.tensorboard=false"]


def _biases(trainer) -> dict[str, torch.Tensor]:
    return {name: layer.gate.expert_bias.clone() for name, layer in moe_layers(trainer.state.stages)}


def _trainer_worker(rank, world, recipe_yaml, prepared, steps, save_at):
    """``steps`` steps (from a checkpoint when the recipe resumes) with the host reads of each step
    counted and each layer's router counts recorded; saves after step ``save_at``."""
    import torch.distributed as dist

    from plait.train.trainer import Trainer
    from test_trainer import HostReadCounter

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    layers = moe_layers(trainer.state.stages)
    loads = _record_loads(layers)
    batches, losses, reads = iter(trainer.run.loader), [], []
    start = trainer.state.start_step
    for step in range(start, start + steps):
        batch = next(batches)
        with HostReadCounter() as counter:
            trainer.run_step(batch)
        reads.append(counter.count)
        losses.append(trainer.run.metrics.read(average_over=trainer.state.dp, loss_from=trainer.state.pp)["loss"])
        if step + 1 == save_at:
            trainer.save_checkpoint(step + 1, sync=True)
    trainer.finish_checkpoints()
    trainer.run.loader.close()
    microbatches = trainer.state.recipe.parallel.microbatches
    step_loads = {}
    for (name, _), forwards in zip(layers, loads, strict=True):
        per_step = torch.stack([sum(forwards[s * microbatches:(s + 1) * microbatches]) for s in range(steps)])
        if world > 1:
            dist.all_reduce(per_step)  # the replicas' counts (dp = world in these runs)
        step_loads[name] = per_step
    return {"losses": losses, "reads": reads, "biases": _biases(trainer), "loads": step_loads, "start": start}


def _train(corpus, out_dir, items, world, steps, save_at=-1):
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = TINY + items + [f"data.source={corpus}", f"run.output_dir={out_dir}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    return run_distributed(_trainer_worker, world, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared,
                           steps, save_at)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


@pytest.mark.slow  # one process through the trainer (~5 s on an idle machine)
def test_trainer_moves_the_bias_by_the_step_loads_without_host_reads(corpus, tmp_path):
    (r,) = _train(corpus, tmp_path / "run", ["data.micro_batch_size=2", "parallel.microbatches=2"], 1, 3)
    assert r["reads"] == [0, 0, 0], f"host reads per step {r['reads']}"
    for name, bias in r["biases"].items():
        assert torch.allclose(bias, _reference_bias(list(r["loads"][name])), atol=1e-7), name
        assert bias.abs().sum() > 0


@pytest.mark.slow  # two runs on two processes and one on one, 4 steps each
def test_dp2_and_ep2_biases_equal_one_process(corpus, tmp_path):
    """Micro-batch B on 2 replicas = one process with micro-batch 2B: the step loads summed over the
    replicas are the one process's, so the biases, hence the routing and the losses, stay equal."""
    steps = 4
    (ref,) = _train(corpus, tmp_path / "ref", ["data.micro_batch_size=4", "parallel.microbatches=1"], 1, steps)
    for layout in (["parallel.dp=2"], ["parallel.dp=2", "parallel.ep=2"]):
        results = _train(corpus, tmp_path / layout[-1].replace("=", ""),
                         ["data.micro_batch_size=2", "parallel.microbatches=1"] + layout, 2, steps)
        for r in results:
            assert r["reads"] == [0] * steps
            assert max_relative(r["losses"], ref["losses"]) <= 1e-5, (layout, r["losses"], ref["losses"])
            for name, bias in ref["biases"].items():
                assert torch.equal(r["loads"][name], ref["loads"][name]), (layout, name)
                assert torch.allclose(r["biases"][name], bias, atol=1e-7), (layout, name)


@pytest.mark.slow  # three one-process runs through the trainer, with a checkpoint
def test_resumed_run_continues_the_unbroken_runs_biases(corpus, tmp_path):
    items = ["data.micro_batch_size=2", "parallel.microbatches=2", "checkpoint.async_save=false"]
    (unbroken,) = _train(corpus, tmp_path / "unbroken", items, 1, 6)
    (first,) = _train(corpus, tmp_path / "resumed", items, 1, 3, save_at=3)
    (second,) = _train(corpus, tmp_path / "continued", items + [
        f"checkpoint.resume={tmp_path / 'resumed' / 'checkpoints' / 'step-00000003'}"], 1, 3)
    assert second["start"] == 3
    assert max_relative(first["losses"] + second["losses"], unbroken["losses"]) <= 1e-6
    for name, bias in unbroken["biases"].items():
        assert torch.equal(second["biases"][name], bias), name
        assert not torch.equal(first["biases"][name], bias), "the biases kept moving after the checkpoint"
