"""The global-batch load-balancing loss (``moe.aux_loss_scope: global_batch``) against a hand-written
reference, under gradient accumulation, activation checkpointing and data parallelism.

Reference (one process, autograd): a step over replicas ``r`` and micro-batches ``m`` minimises

    mean over r, m of [ loss(r, m) + coef * mean over MoE layers l of E * sum_i f(m, l)_i * P(r, m, l)_i ]

with ``f(m, l)`` the running share of the step: assignments to each expert over every replica's
micro-batches ``1..m`` divided by their tokens (counted in a first, gradient-free pass), and
``P(r, m, l)`` the mean router probability of that replica's micro-batch (differentiable). The
runtime never sees the aux loss: each layer adds its gradient in its own backward with ``f`` from
the injected :class:`~plait.moe.step_load.StepLoad`, so equal gradients prove the running sum, its
reset, its all-reduce and its replay under recomputation.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from plait.activation_checkpointing import apply_activation_checkpointing
from plait.data.batch import TokenBatch
from plait.materialize import build_model, build_stages
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.mixtral import MixtralConfig
from plait.moe import MoeSection, configure_moe, moe_layers
from plait.moe.step_load import attach_load_balancing
from plait.nn.moe import assignments_per_expert, load_balancing_loss
from plait.pipeline.runtime import PipelineRuntime
from trainer_runs import corpus_dir, max_relative, merged_weights, run_recipe, weight_errors

TOL = 1e-5
AUX = 0.5  # large, so a wrong share would move the router gradients visibly
MB, SEQ, E = 2, 8, 4


def _config() -> MixtralConfig:
    return MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=2,
                         max_position_embeddings=32, tie_word_embeddings=False)


def _batches(replicas: int, microbatches: int) -> torch.Tensor:
    """``[replicas, microbatches, MB, SEQ]``; low token ids only, so the routing is far from balanced."""
    return torch.randint(0, 12, (replicas, microbatches, MB, SEQ), generator=torch.Generator().manual_seed(3))


def _reference(batches: torch.Tensor, scope: str, config=None) -> dict[str, torch.Tensor]:
    """Gradients of the objective in the module docstring (``scope="micro_batch"``: ``f`` of the
    replica's micro-batch alone), summed so that they equal the replicas' averaged gradients."""
    replicas, microbatches = batches.shape[:2]
    model = build_model(config or _config(), single_process_mesh(), seed=5)
    routings: list = []
    layers = moe_layers([model])
    for _, layer in layers:
        layer.gate.register_forward_hook(lambda m, a, out: routings.append(out))
    counts = torch.zeros(replicas, microbatches, len(layers), E)  # the first pass: who went where
    with torch.no_grad():
        for r in range(replicas):
            for m in range(microbatches):
                routings.clear()
                model(batches[r, m])
                counts[r, m] = torch.stack([assignments_per_expert(x.experts, E).float() for x in routings])
    tokens = MB * SEQ
    for r in range(replicas):
        for m in range(microbatches):
            if scope == "global_batch":
                share = counts[:, :m + 1].sum(dim=(0, 1)) / (tokens * replicas * (m + 1))
            else:
                share = counts[r, m] / tokens
            routings.clear()
            loss = model(batches[r, m], batches[r, m])
            aux = torch.stack([load_balancing_loss(x.probs, x.experts, share=share[i])
                               for i, x in enumerate(routings)]).mean()
            ((loss + AUX * aux) / (microbatches * replicas)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _run(stages, mesh, batch: torch.Tensor, scope: str, steps: int = 1, replicas=None, config=None) -> list:
    """``steps`` forward/backward passes of the runtime over ``batch`` ``[microbatches, MB, SEQ]``,
    each a new step (gradients zeroed); returns each layer's running counts at the end."""
    section = MoeSection(aux_loss_coef=AUX, aux_loss_scope=scope)
    microbatches = batch.shape[0]
    configure_moe(stages, section, config or _config(), microbatches=microbatches, stats=False)
    hooks = attach_load_balancing(stages, section, replicas, microbatches=microbatches)
    runtime = PipelineRuntime(stages, mesh, schedule="1f1b", microbatches=microbatches, micro_batch_size=MB,
                              seq_len=SEQ, hidden_size=32, sequence_parallel=False, dtype=torch.float32)
    for _ in range(steps):
        for stage in stages:
            stage.zero_grad()
        if hooks is not None:
            hooks.start_step()
        runtime.run(TokenBatch(input_ids=batch, labels=batch), train=True)
    return [] if hooks is None else [t.running.clone() for t in hooks.trackers]


def _max_diff(grads: dict, ref: dict) -> float:
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    return max((grads[n] - ref[n]).abs().max().item() for n in ref)


ROUTER = "model.layers.0.block_sparse_moe.gate.weight"


@pytest.mark.parametrize("checkpointing", [False, True])
def test_global_scope_accumulates_the_steps_shares_over_micro_batches(checkpointing):
    """3 micro-batches of one process, twice (the second step must restart the running sum), with
    and without full activation checkpointing (the recomputation replays the original shares)."""
    batches = _batches(1, 3)
    (stage,) = build_stages(_config(), single_process_mesh(), [[0, 1]], seed=5)
    if checkpointing:
        apply_activation_checkpointing([stage], "full")
    running = _run([stage], single_process_mesh(), batches[0], "global_batch", steps=2)
    assert [int(r[-1]) for r in running] == [3 * MB * SEQ] * 2, "each layer counted the step's 3 forwards once"
    assert [int(r[:-1].sum()) for r in running] == [3 * MB * SEQ * 2] * 2
    grads = {n: p.grad for n, p in stage.named_parameters()}
    ref = _reference(batches, "global_batch")
    assert _max_diff(grads, ref) <= TOL
    # negative control: the per-micro-batch shares give other router gradients on this unbalanced batch
    micro = _reference(batches, "micro_batch")
    assert (micro[ROUTER] - ref[ROUTER]).abs().max() > 1e-3


def test_micro_batch_scope_is_unchanged_and_needs_no_step_hooks():
    batches = _batches(1, 3)
    (stage,) = build_stages(_config(), single_process_mesh(), [[0, 1]], seed=5)
    assert _run([stage], single_process_mesh(), batches[0], "micro_batch") == []
    assert all(layer.load_tracker is None for _, layer in moe_layers([stage]))
    assert _max_diff({n: p.grad for n, p in stage.named_parameters()}, _reference(batches, "micro_batch")) <= TOL


def test_global_scope_without_the_step_hooks_is_refused():
    model = build_model(_config(), single_process_mesh(), seed=5)
    ids = _batches(1, 1)[0, 0]
    section = MoeSection(aux_loss_coef=AUX, aux_loss_scope="global_batch")
    configure_moe([model], section, _config(), microbatches=1)
    with pytest.raises(RuntimeError, match="attach_load_balancing"):
        model(ids)
    hooks = attach_load_balancing([model], section, None, microbatches=1)
    assert hooks is not None
    hooks.start_step()
    model(ids)
    with torch.no_grad():
        model(ids)  # evaluation forwards do not count
    with pytest.raises(RuntimeError, match="start_step"):  # a second step's forward without the reset
        model(ids)


# ------------------------------------------------------------------------------ data parallelism
def _dp_worker(rank: int, world: int, batches: torch.Tensor, scope: str) -> dict:
    import torch.distributed as dist

    mesh = ParallelMesh(world, rank, dp=world)
    (stage,) = build_stages(_config(), mesh, [[0, 1]], seed=5)
    _run([stage], mesh, batches[rank], scope, replicas=mesh.info("dp_cp"))
    grads = {}
    for n, p in stage.named_parameters():  # what data parallelism's gradient average does
        dist.all_reduce(p.grad)
        grads[n] = p.grad / world
    return grads


@pytest.mark.slow  # two processes (~5 s on an idle machine)
def test_dp2_global_scope_with_accumulation_equals_the_reference():
    """DP=2 x 2 micro-batches: the shares are summed over both replicas and the micro-batches so far."""
    batches = _batches(2, 2)
    ref = _reference(batches, "global_batch")
    for grads in run_distributed(_dp_worker, 2, batches, "global_batch"):
        assert _max_diff(grads, ref) <= TOL
    micro = run_distributed(_dp_worker, 2, batches, "micro_batch")[0]  # negative control
    assert _max_diff(micro, _reference(batches, "micro_batch")) <= TOL
    assert (micro[ROUTER] - ref[ROUTER]).abs().max() > 1e-3


def _qwen3_moe_first_layer_dense():
    from plait.models.qwen3_moe import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=E, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                          max_position_embeddings=32, tie_word_embeddings=False)


def _pp_worker(rank: int, world: int, batches: torch.Tensor) -> tuple[dict, bool]:
    mesh = ParallelMesh(world, rank, pp=world)
    config = _qwen3_moe_first_layer_dense()
    stages = build_stages(config, mesh, [[0], [1, 2]], seed=5)
    _run(stages, mesh, batches[0], "global_batch", replicas=mesh.info("dp_cp"), config=config)
    has_moe = bool(moe_layers(stages))
    return {n: p.grad.clone() for stage in stages for n, p in stage.named_parameters()}, has_moe


@pytest.mark.slow  # two processes
def test_pp2_global_scope_with_a_stage_without_moe_layers_equals_the_reference():
    """PP=2 x 3 micro-batches (1F1B: backwards interleave with the later forwards); stage 0 holds only
    a dense layer, so it has no step hooks and adds no loss gradient."""
    batches = _batches(1, 3)
    results = run_distributed(_pp_worker, 2, batches)
    assert [has for _, has in results] == [False, True]
    grads = {n: g for r, _ in results for n, g in r.items()}
    assert _max_diff(grads, _reference(batches, "global_batch", _qwen3_moe_first_layer_dense())) <= TOL


# ------------------------------------------------------------------------------ through the trainer
BASE = ["model.family=mixtral", "model.hidden_size=64", "model.intermediate_size=32", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "model.num_local_experts=4",
        "model.num_experts_per_tok=2", "model.tie_word_embeddings=false", "moe.aux_loss_coef=0.5",
        "moe.aux_loss_scope=global_batch", "data.vocab_size=320", "data.seq_len=32",
        "parallel.sequence_parallel=false", "optimizer.grad_clip=1.0", "scheduler.warmup_steps=2",
        "optimizer.lr=1.5e-3", "parallel.tp=1", "logging.progress_bar=false", "logging.tensorboard=false",
        "parallel.bucket_mb=0.05", "train.sample_tokens=0", "parallel.microbatches=1"]
STEPS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


@pytest.mark.slow  # three runs of 6 steps through the trainer, two of them on two processes
def test_dp2_and_ep2_global_scope_equal_one_process_with_twice_the_micro_batch(corpus, tmp_path):
    """Micro-batch B on each of 2 replicas = one process with micro-batch 2B (the same tokens): the
    global shares are the same, and the replicas' mean of their local P is the whole batch's."""
    ref = run_recipe(corpus, tmp_path / "ref", BASE + ["data.micro_batch_size=4"], 1, STEPS)[0]
    micro = run_recipe(corpus, tmp_path / "micro", BASE + ["data.micro_batch_size=2", "parallel.dp=2",
                                                           "moe.aux_loss_scope=micro_batch"], 2, 2)
    assert max_relative(micro[0]["norms"][:2], ref["norms"][:2]) > 1e-4, "negative control: micro != global"
    for layout in (["parallel.dp=2"], ["parallel.dp=2", "parallel.ep=2"]):
        results = run_recipe(corpus, tmp_path / layout[-1].replace("=", ""), BASE + ["data.micro_batch_size=2"]
                             + layout, 2, STEPS)
        for rank, r in enumerate(results):
            assert max_relative(r["losses"], ref["losses"]) <= 1e-5, (layout, rank, r["losses"], ref["losses"])
            assert max_relative(r["norms"], ref["norms"]) <= 5e-5, (layout, rank, r["norms"], ref["norms"])
        for key, err in weight_errors(merged_weights(results), ref["weights"]).items():
            assert err <= 1e-5, f"{layout} {key}: relative weight difference {err:.2e}"
