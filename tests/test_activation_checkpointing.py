"""Activation checkpointing with dropout: recomputation must replay every random draw exactly.

The comparisons are bitwise (``torch.equal``), not within a tolerance: a checkpointed forward
runs the same fp32 kernels on the same inputs as the original, so any difference means a dropout
mask (from the global generator or from the per-TP-rank stream) was redrawn differently. The
negative control shows the tests can fail: recomputing without replaying the per-rank stream
gives different gradients.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed

STEPS = 3


def _config(**kw):
    from plait.models.llama import LlamaConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.1, hidden_dropout=0.1)
    base.update(kw)
    return LlamaConfig(**base)


def _batch(step: int) -> torch.Tensor:
    # the same tokens on every rank (a TP group sees one batch)
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(100 + step))


def _no_replay_checkpointing(model) -> int:
    """Negative control: checkpoint every block the plain way, without replaying the tracker."""
    from torch.utils.checkpoint import checkpoint

    from plait.activation_checkpointing import decoder_blocks

    blocks = decoder_blocks(model)
    for _, block in blocks:
        block.forward = (lambda *a, _f=block.forward: checkpoint(_f, *a, use_reentrant=False,
                                                                 preserve_rng_state=True))
    return len(blocks)


def _train(build, mode, names=None):
    """Three AdamW steps from fixed seeds; per step the loss, the gradients and the saved-tensor count."""
    from plait.activation_checkpointing import apply_activation_checkpointing

    model = build()
    model.train()
    wrapped = _no_replay_checkpointing(model) if mode == "no-replay" else \
        apply_activation_checkpointing([model], mode, names)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1234)  # the global generator: identical on the ranks of the TP group
    losses, grads, saved = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        count = [0]

        def pack(t, count=count):
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(_batch(step), _batch(step))
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        saved.append(count[0])
        opt.step()
    tracker = model.rng_tracker.get_state()
    return {"wrapped": wrapped, "losses": losses, "grads": grads, "saved": saved, "tracker": tracker,
            "global": torch.get_rng_state()}


def _compare(ref, run):
    """``(losses equal, first differing gradient or None, tracker and global states equal)``."""
    losses_equal = all(torch.equal(a, b) for a, b in zip(ref["losses"], run["losses"], strict=True))
    first_diff = None
    for step, (gr, g) in enumerate(zip(ref["grads"], run["grads"], strict=True)):
        for name, t in gr.items():
            if not torch.equal(t, g[name]):
                first_diff = first_diff or f"step {step} {name}"
    states_equal = (torch.equal(ref["global"], run["global"])
                    and ref["tracker"].keys() == run["tracker"].keys()
                    and all(torch.equal(ref["tracker"][k], run["tracker"][k]) for k in ref["tracker"]))
    return losses_equal, first_diff, states_equal


SELECTIONS = [("full", None), ("selective", ["self_attn", "mlp"]), ("selective", ["self_attn.core"]),
              ("selective", None)]


def _tp_worker(rank, world, sp):
    from builders import build_llama
    from plait.mesh import ParallelMesh
    from plait.models.llama.parallelize import kv_replication_for
    from plait.tensor_parallel.random import TensorParallelRNG, TrackedDropout

    cfg = _config()
    mesh = ParallelMesh(world, rank, tp=world, kv_replication=kv_replication_for(cfg, world))

    def build():
        return build_llama(cfg, mesh, seed=3, sequence_parallel=sp)

    out = {}
    # dropout is active: the training-mode loss differs from the evaluation-mode loss, and the
    # per-rank stream advanced during the training forward
    model = build()
    before = model.rng_tracker.get_state()
    with torch.no_grad():
        model.eval()
        eval_loss = model(_batch(0), _batch(0))
        model.train()
        torch.manual_seed(1234)
        train_loss = model(_batch(0), _batch(0))
    out["dropout_active"] = not torch.equal(eval_loss, train_loss)
    after = model.rng_tracker.get_state()
    out["tracker_used"] = before.keys() != after.keys() or any(not torch.equal(before[k], after[k]) for k in before)
    # residual dropout acts on sequence shards under SP and so must draw from the per-rank stream
    out["tracked_residual"] = [isinstance(b.residual_dropout, TrackedDropout) for b in model.model.layers]
    # the per-rank stream differs across the TP group, the global generator does not
    probe = TensorParallelRNG(3, mesh.tp_rank)
    torch.manual_seed(7)
    with probe.fork():
        mine = torch.rand(16)
    shared = torch.rand(16)
    both = [torch.empty(16) for _ in range(world)], [torch.empty(16) for _ in range(world)]
    dist.all_gather(both[0], mine)
    dist.all_gather(both[1], shared)
    out["stream_differs"] = not torch.equal(both[0][0], both[0][1])
    out["global_same"] = torch.equal(both[1][0], both[1][1])

    ref = _train(build, "off")
    for mode, names in SELECTIONS + [("no-replay", None)]:
        run = _train(build, mode, names)
        losses_equal, first_diff, states_equal = _compare(ref, run)
        out[(mode, None if names is None else tuple(names))] = {
            "wrapped": run["wrapped"], "losses_equal": losses_equal, "first_diff": first_diff,
            "states_equal": states_equal, "saved": run["saved"][0], "ref_saved": ref["saved"][0]}
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_checkpointing_bitwise_equal_with_dropout(sp):
    layers = _config().num_hidden_layers
    expected_wrapped = {("full", None): layers, ("selective", ("self_attn", "mlp")): 2 * layers,
                        ("selective", ("self_attn.core",)): layers, ("selective", None): 2 * layers}
    for rank, r in enumerate(run_distributed(_tp_worker, 2, sp)):
        assert r["dropout_active"], f"rank {rank}: dropout did not change the loss"
        assert r["tracker_used"], f"rank {rank}: the per-rank stream was not drawn from"
        assert r["stream_differs"] and r["global_same"], f"rank {rank}: per-rank/global streams wrong"
        assert r["tracked_residual"] == [sp] * layers
        for key, want in expected_wrapped.items():
            res = r[key]
            assert res["wrapped"] == want, f"rank {rank} {key}: wrapped {res['wrapped']}, expected {want}"
            assert res["saved"] < res["ref_saved"], f"rank {rank} {key}: checkpointing saved no tensors"
            assert res["losses_equal"], f"rank {rank} {key}: losses differ from the uncheckpointed run"
            assert res["first_diff"] is None, f"rank {rank} {key}: gradient differs at {res['first_diff']}"
            assert res["states_equal"], f"rank {rank} {key}: RNG states after training differ"
        control = r[("no-replay", None)]
        assert control["wrapped"] == layers
        assert control["first_diff"] is not None, (
            f"rank {rank}: recomputing without replaying the per-rank stream gave equal gradients; "
            f"the test could not detect a missing replay")


# ---------------------------------------------------------------------------- single process
def _single_build(**kw):
    from builders import build_llama
    from plait.mesh import single_process_mesh

    return lambda: build_llama(_config(**kw), single_process_mesh(), seed=3)


@pytest.mark.parametrize("mode,names", SELECTIONS + [("selective", ["mlp.act", "input_layernorm"])])
def test_single_process_bitwise_equal(mode, names):
    build = _single_build()
    ref, run = _train(build, "off"), _train(build, mode, names)
    losses_equal, first_diff, states_equal = _compare(ref, run)
    assert run["wrapped"] > 0 and run["saved"][0] < ref["saved"][0]
    assert losses_equal and first_diff is None and states_equal, first_diff


def test_dropout_changes_single_process_loss():
    model = _single_build()()
    with torch.no_grad():
        eval_loss = model.eval()(_batch(0), _batch(0))
        train_loss = model.train()(_batch(0), _batch(0))
    assert not torch.equal(eval_loss, train_loss)


def test_names_unchanged_eval_bypass_and_deepcopy():
    from plait.activation_checkpointing import apply_activation_checkpointing, checkpointed_modules

    model = _single_build()()
    params = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    assert apply_activation_checkpointing([model], "selective", ["self_attn", "mlp"]) == 4
    assert [n for n, _ in model.named_parameters()] == params
    assert [n for n, _ in model.named_modules()] == modules
    assert sorted(n for n, _ in checkpointed_modules(model)) == [
        "model.layers.0.mlp", "model.layers.0.self_attn", "model.layers.1.mlp", "model.layers.1.self_attn"]
    model.eval()
    with torch.no_grad():
        ref = model(_batch(0), _batch(0))
    twin = copy.deepcopy(model)  # the wrapped forwards must follow the copy, not the original
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        assert torch.equal(model(_batch(0), _batch(0)), ref)
        assert not torch.equal(twin(_batch(0), _batch(0)), ref)
    twin.train()
    twin(_batch(0), _batch(0)).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in twin.parameters())


def test_errors_name_the_problem():
    from plait.activation_checkpointing import apply_activation_checkpointing, checkpointable_names

    model = _single_build()()
    with pytest.raises(ValueError, match=r"'self_atn'.*'model\.layers\.0'.*valid names: .*self_attn\.core"):
        apply_activation_checkpointing([model], "selective", ["self_atn"])
    with pytest.raises(ValueError, match=r"mode='partial' is not valid.*'off', 'full', 'selective'"):
        apply_activation_checkpointing([model], "partial")
    with pytest.raises(ValueError, match="only used with mode='selective'"):
        apply_activation_checkpointing([model], "full", ["mlp"])
    with pytest.raises(ValueError, match="'self_attn.core' is inside 'self_attn'"):
        apply_activation_checkpointing([model], "selective", ["self_attn", "self_attn.core"])
    assert all(not hasattr(m, "_plait_checkpointed") for m in model.modules())  # nothing half-applied
    assert apply_activation_checkpointing([model], "off") == 0
    assert apply_activation_checkpointing([model], "none") == 0  # the planner's spelling of "off"
    assert apply_activation_checkpointing([model], "full") == 2
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_activation_checkpointing([model], "full")
    assert "self_attn.core" in checkpointable_names(model.config)


def test_pipeline_stages():
    """Two stages built in one process (pp=1 mesh, two global stages): counts, names, bitwise equality."""
    from builders import build_llama_stages
    from plait.activation_checkpointing import apply_activation_checkpointing
    from plait.mesh import single_process_mesh

    cfg = _config(num_hidden_layers=3)

    def run(mode):
        stages = build_llama_stages(cfg, single_process_mesh(), [[0, 1], [2]], seed=3)
        assert all(s.rng_tracker is stages[0].rng_tracker for s in stages)
        names = [[n for n, _ in s.named_parameters()] for s in stages]
        wrapped = apply_activation_checkpointing(stages, mode)
        assert [[n for n, _ in s.named_parameters()] for s in stages] == names
        torch.manual_seed(1234)
        for s in stages:
            s.train()
        h = stages[0](_batch(0), 8)
        loss = stages[1](h, 8, _batch(0))
        loss.backward()
        return wrapped, loss, {n: p.grad for s in stages for n, p in s.named_parameters()}

    _, ref_loss, ref_grads = run("off")
    wrapped, loss, grads = run("full")
    assert wrapped == 3
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


# ---------------------------------------------------------------------------- the RNG stream
def test_tensor_parallel_rng_fork_and_state():
    from plait.tensor_parallel.random import TensorParallelRNG

    torch.manual_seed(0)
    outer = torch.get_rng_state()
    rng = TensorParallelRNG(5, tp_rank=1)
    start = rng.get_state()
    with rng.fork():
        a = torch.rand(8)
    assert torch.equal(torch.get_rng_state(), outer), "fork must restore the global generator"
    with rng.fork():
        b = torch.rand(8)
    assert not torch.equal(a, b), "consecutive forks continue one stream"
    assert torch.equal(torch.cat([a, b]), torch.rand(16, generator=torch.Generator().manual_seed(rng.seed)))
    rng.set_state(start)
    with rng.fork():
        assert torch.equal(torch.rand(8), a), "set_state replays the stream"
    assert rng.seed != TensorParallelRNG(5, tp_rank=0).seed
    with pytest.raises(RuntimeError), rng.fork():
        torch.rand(1)
        raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), outer), "fork restores the global generator on errors too"


def test_parallelize_rejects_a_tracker_of_another_rank():
    from plait.mesh import single_process_mesh
    from plait.models.llama import LlamaForCausalLM
    from plait.models.llama.parallelize import parallelize
    from plait.tensor_parallel.random import TensorParallelRNG

    with torch.device("meta"):
        model = LlamaForCausalLM(_config())
    with pytest.raises(ValueError, match="tp_rank=1"):
        parallelize(model, single_process_mesh(), rng=TensorParallelRNG(0, 1))


def test_config_dropout_fields_and_hf_round_trip():
    from plait.models.errors import ModelConfigError
    from plait.models.llama import LlamaConfig

    cfg = _config(attention_dropout=0.1, hidden_dropout=0.0)
    d = cfg.to_hf_dict()
    assert d["attention_dropout"] == 0.1 and "hidden_dropout" not in d
    assert dataclasses.replace(LlamaConfig.from_hf_dict(d), extra={}) == cfg
    cfg2 = _config(hidden_dropout=0.2)
    assert LlamaConfig.from_hf_dict(cfg2.to_hf_dict()).hidden_dropout == 0.2
    assert LlamaConfig().to_hf_dict()["attention_dropout"] == 0.0
    with pytest.raises(ModelConfigError, match="attention_dropout=1.5"):
        _config(attention_dropout=1.5)


def test_trainer_checkpointing_is_bitwise_with_dropout_at_tp2(tmp_path_factory):
    """Through the recipe and the real trainer: full and selective checkpointing give the same
    losses, grad norms and final weights, bit for bit, as no checkpointing (fp32, dropout on, TP=2)."""
    from trainer_runs import corpus_dir, run_recipe

    corpus = corpus_dir(tmp_path_factory)
    out = tmp_path_factory.mktemp("runs")
    base = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
            "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
            "data.micro_batch_size=4", "parallel.tp=2", "parallel.sequence_parallel=true",
            "model.attention_dropout=0.1", "model.hidden_dropout=0.1", "scheduler.warmup_steps=1",
            "logging.progress_bar=false", "logging.tensorboard=false"]
    runs = {mode: run_recipe(corpus, out / mode, base + extra, 2, 4)
            for mode, extra in {"off": [], "full": ["train.activation_checkpointing=full"],
                                "selective": ["train.activation_checkpointing=selective",
                                              "train.checkpoint_modules=[self_attn.core,mlp]"]}.items()}
    ref = runs["off"]
    for mode in ("full", "selective"):
        for r, base_r in zip(runs[mode], ref, strict=True):
            assert r["losses"] == base_r["losses"] and r["norms"] == base_r["norms"], mode
            for k, v in base_r["weights"].items():
                assert torch.equal(r["weights"][k], v), (mode, k)
