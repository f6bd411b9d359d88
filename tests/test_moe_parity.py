"""MoE training under data, expert and pipeline parallelism (and ZeRO-1) against one process: 20 AdamW
steps of a tiny Mixtral through the real trainer, fp32, with the load-balancing and z-losses on
(large coefficients, so a mis-normalised loss gradient would move the trajectory) and, in one
case, a capacity factor that drops assignments.

The aux loss is per micro-batch (``moe.aux_loss_scope: micro_batch``), so the single-process run
takes ``dp x`` the micro-batches of the same size: every micro-batch, hence every aux loss, is the
same as in the parallel run. Tolerances are those of tests/test_dp_parity.py. All slow (each
case trains two runs of 20 steps: 20-60 s on 2 cores).
"""

from __future__ import annotations

import pytest

from trainer_runs import corpus_dir, max_relative, merged_weights, run_recipe, weight_errors

STEPS = 20
BASE = ["model.family=mixtral", "model.hidden_size=64", "model.intermediate_size=32", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "model.num_local_experts=4",
        "model.num_experts_per_tok=2", "model.tie_word_embeddings=false", "moe.aux_loss_coef=0.1",
        "moe.z_loss_coef=0.01", "data.vocab_size=320", "data.seq_len=32", "data.micro_batch_size=2",
        "parallel.sequence_parallel=false", "optimizer.grad_clip=1.0", "scheduler.warmup_steps=2",
        "optimizer.lr=1.5e-3", "parallel.tp=1", "logging.progress_bar=false", "logging.tensorboard=false",
        "parallel.bucket_mb=0.05", "train.sample_tokens=0"]

#: name: (overrides, world, microbatches per DP rank, dp)
LAYOUTS = {
    "dp2": (["parallel.dp=2"], 2, 2, 2),
    "dp2-capacity": (["parallel.dp=2", "moe.capacity_factor=1.0"], 2, 2, 2),
    "pp2xdp2-zero1": (["parallel.pp=2", "parallel.dp=2", "parallel.zero1=true"], 4, 4, 2),
    "ep2": (["parallel.dp=2", "parallel.ep=2"], 2, 2, 2),
    "ep2-capacity": (["parallel.dp=2", "parallel.ep=2", "moe.capacity_factor=1.0"], 2, 2, 2),
    "ep4": (["parallel.dp=4", "parallel.ep=4"], 4, 1, 4),
    "ep2xdp2": (["parallel.dp=4", "parallel.ep=2"], 4, 1, 4),
    "ep2xpp2": (["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"], 4, 4, 2),
    "ep2-exact": (["parallel.dp=2", "parallel.ep=2", "moe.dispatch=exact"], 2, 2, 2),
    "ep2-exact-capacity": (["parallel.dp=2", "parallel.ep=2", "moe.dispatch=exact", "moe.capacity_factor=1.0"],
                           2, 2, 2),
    "ep4-exact-checkpointing": (["parallel.dp=4", "parallel.ep=4", "moe.dispatch=exact",
                                 "train.activation_checkpointing=full"], 4, 1, 4),
    "ep2-zero1": (["parallel.dp=2", "parallel.ep=2", "parallel.zero1=true"], 2, 2, 2),
    "ep2xdp2-zero1": (["parallel.dp=4", "parallel.ep=2", "parallel.zero1=true"], 4, 1, 4),
    "ep2-checkpointing": (["parallel.dp=2", "parallel.ep=2", "train.activation_checkpointing=full"], 2, 2, 2),
    "tp2": (["parallel.tp=2"], 2, 2, 1),
    "ep2xtp2": (["parallel.tp=2", "parallel.dp=2", "parallel.ep=2"], 4, 2, 2),
    # sequence parallelism: each TP rank routes its own sequence shard (plait.moe.sequence_parallel)
    "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, 2, 1),
    "tp2-sp-global-sigmoid": (["parallel.tp=2", "parallel.sequence_parallel=true", "moe.aux_loss_scope=global_batch",
                               "moe.router=sigmoid", "moe.router_bias_update_rate=0.01"], 2, 2, 1),
    "ep2xtp2-sp": (["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.sequence_parallel=true"], 4, 2, 2),
    "ep2xtp2-sp-exact": (["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                          "moe.dispatch=exact"], 4, 2, 2),
    "ep2xtp2-sp-checkpointing": (["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                                  "train.activation_checkpointing=full", "parallel.zero1=true"], 4, 2, 2),
    "pp2xtp2-sp": (["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], 4, 4, 1),
}
#: TP adds partial sums in another order (see tests/test_dp_parity.py)
WEIGHT_TOL = {name: 5e-5 for name in LAYOUTS if "tp2" in name}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(corpus, tmp_path, name):
    overrides, world, microbatches, dp = LAYOUTS[name]
    same = [o for o in overrides if o.startswith("moe.")]
    ref = run_recipe(corpus, tmp_path / "ref", BASE + same + [f"parallel.microbatches={microbatches * dp}"], 1,
                     STEPS)[0]
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, "the reference must learn for the comparison to mean anything"
    results = run_recipe(corpus, tmp_path / "run", BASE + overrides + [f"parallel.microbatches={microbatches}"],
                         world, STEPS)
    for rank, r in enumerate(results):
        rel = max_relative(r["losses"], ref["losses"])
        assert rel <= 1e-5, f"rank {rank}: relative loss difference {rel:.2e}\n{r['losses']}\n{ref['losses']}"
        first = abs(r["norms"][0] - ref["norms"][0]) / ref["norms"][0]
        assert first <= 2e-6, f"rank {rank}: first-step grad norm {r['norms'][0]} vs {ref['norms'][0]}"
        assert max_relative(r["norms"], ref["norms"]) <= 5e-5
    for key, err in weight_errors(merged_weights(results), ref["weights"]).items():
        assert err <= WEIGHT_TOL.get(name, 1e-5), f"{key}: relative weight difference {err:.2e}"
