"""Data parallelism, ZeRO-1/2/3 and their 3-D combinations against one process: 20 AdamW steps, fp32.

Every layout trains the same model on the same global batches through the real trainer. The
per-step losses must equal the single-process run within a relative 1e-5, and so must the final
weights (norm-relative per tensor; with TP 5e-5, see tests/test_pipeline_parity.py for why).

The pre-clip gradient norm is compared at every step too. On the first step both runs hold the
same weights, so the norm must agree to 2e-6: that checks that every gradient entry is counted
exactly once (a replica counted twice, a lost shard or a missing DP average is off by O(1)).
Later steps compare runs whose weights have drifted apart by reduction-order round-off, and a
norm, unlike the loss, is amplified by that drift around loss spikes (measured: 1.5e-5 at a
spike for DP=2); they must agree to 5e-5. A small bucket cap (50 kB) makes every run use
many buckets, with parameters straddling bucket and ZeRO shard boundaries.
"""

from __future__ import annotations

import pytest

from trainer_runs import corpus_dir, max_relative, merged_weights, run_recipe, weight_errors

STEPS = 20
BASE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=4", "data.vocab_size=320", "data.seq_len=32",
        "data.micro_batch_size=2", "parallel.sequence_parallel=false", "optimizer.grad_clip=1.0",
        "scheduler.warmup_steps=2", "optimizer.lr=1.5e-3", "parallel.tp=1", "logging.progress_bar=false",
        "logging.tensorboard=false", "parallel.bucket_mb=0.05"]

#: name: (overrides, world, microbatches per DP rank, dp)
LAYOUTS = {
    "dp2": (["parallel.dp=2"], 2, 2, 2),
    "dp2-zero1": (["parallel.dp=2", "parallel.zero1=true"], 2, 2, 2),
    "dp2-accum4": pytest.param((["parallel.dp=2"], 2, 4, 2), marks=pytest.mark.slow),
    "dp2-zero1-no-overlap": pytest.param((["parallel.dp=2", "parallel.zero1=true",
                                           "parallel.overlap_grad_reduce=false"], 2, 2, 2), marks=pytest.mark.slow),
    "dp4-zero1-tied": pytest.param((["parallel.dp=4", "parallel.zero1=true", "model.tie_word_embeddings=true"],
                                    4, 1, 4), marks=pytest.mark.slow),
    "tp2xdp2-zero1": (["parallel.tp=2", "parallel.dp=2", "parallel.zero1=true"], 4, 2, 2),
    "dp2-zero2": (["parallel.dp=2", "parallel.zero=2"], 2, 2, 2),
    "dp2-zero3": (["parallel.dp=2", "parallel.zero=3"], 2, 2, 2),
    "dp4-zero2-tied": pytest.param((["parallel.dp=4", "parallel.zero=2", "model.tie_word_embeddings=true"], 4, 1, 4),
                                   marks=pytest.mark.slow),
    "dp4-zero3-accum": pytest.param((["parallel.dp=4", "parallel.zero=3"], 4, 2, 4), marks=pytest.mark.slow),
    "dp2-zero3-keep-ckpt": pytest.param((["parallel.dp=2", "parallel.zero=3", "parallel.reshard_after_forward=false",
                                          "train.activation_checkpointing=full"], 2, 2, 2), marks=pytest.mark.slow),
    "tp2xdp2-zero3-sp": (["parallel.tp=2", "parallel.dp=2", "parallel.zero=3",
                          "parallel.sequence_parallel=true"], 4, 2, 2),
    "pp2xdp2-zero3-tied": (["parallel.pp=2", "parallel.dp=2", "parallel.zero=3",
                            "model.tie_word_embeddings=true"], 4, 4, 2),
    "tp2-kvrep2xdp2-zero1": pytest.param((["parallel.tp=2", "parallel.dp=2", "parallel.zero1=true",
                                           "parallel.kv_replication=2", "model.num_key_value_heads=1"], 4, 2, 2),
                                         marks=pytest.mark.slow),
    # interleaved stages also run by default in test_checkpoint_resume (pp1-to-pp2-vpp2) and the schedule tests
    "pp2xdp2-vpp2": pytest.param((["parallel.pp=2", "parallel.dp=2", "parallel.vpp=2",
                                   "parallel.schedule=interleaved-1f1b"], 4, 4, 2), marks=pytest.mark.slow),
    "pp2xdp2-zero1-tied": (["parallel.pp=2", "parallel.dp=2", "parallel.zero1=true",
                            "model.tie_word_embeddings=true"], 4, 4, 2),
    # 8 ranks on 2 cores (20-30 s): `make test-slow`; every 2-D pair of these axes runs by default
    "pp2xtp2xdp2-zero1-sp": pytest.param((["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "parallel.zero1=true",
                                           "parallel.sequence_parallel=true"], 8, 4, 2), marks=pytest.mark.slow),
}
WEIGHT_TOL = {"tp2xdp2-zero1": 5e-5, "tp2-kvrep2xdp2-zero1": 5e-5, "pp2xtp2xdp2-zero1-sp": 5e-5,
              "tp2xdp2-zero3-sp": 5e-5}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


_REFERENCES: dict[tuple[str, ...], dict] = {}


def _reference(corpus, tmp_path, single: list[str]) -> dict:
    """The single-process run of ``single`` (shared by the layouts that have the same one)."""
    key = tuple(single)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_recipe(corpus, tmp_path / "ref", BASE + single, 1, STEPS)[0]
    return _REFERENCES[key]


def _case(name: str):
    value = LAYOUTS[name]
    return value.values[0] if hasattr(value, "values") else value


@pytest.mark.parametrize("name", [pytest.param(n, marks=getattr(v, "marks", ())) for n, v in LAYOUTS.items()])
def test_layout_matches_single_process(corpus, tmp_path, name):
    overrides, world, microbatches, dp = _case(name)
    tied = "model.tie_word_embeddings=true" in overrides
    model = [o for o in overrides if o.startswith("model.")]
    if not tied:
        overrides, model = overrides + ["model.tie_word_embeddings=false"], model + ["model.tie_word_embeddings=false"]
    single = model + [f"parallel.microbatches={microbatches * dp}"]
    ref = _reference(corpus, tmp_path, single)
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, "the reference must learn for the comparison to mean anything"
    results = run_recipe(corpus, tmp_path / "run", BASE + overrides + [f"parallel.microbatches={microbatches}"],
                         world, STEPS)
    for rank, r in enumerate(results):
        rel = max_relative(r["losses"], ref["losses"])
        assert rel <= 1e-5, f"rank {rank}: relative loss difference {rel:.2e}\n{r['losses']}\n{ref['losses']}"
        first = abs(r["norms"][0] - ref["norms"][0]) / ref["norms"][0]
        assert first <= 2e-6, f"rank {rank}: first-step grad norm {r['norms'][0]} vs {ref['norms'][0]}"
        rel = max_relative(r["norms"], ref["norms"])
        assert rel <= 5e-5, f"rank {rank}: relative grad-norm difference {rel:.2e}\n{r['norms']}\n{ref['norms']}"
    for key, err in weight_errors(merged_weights(results), ref["weights"]).items():
        assert err <= WEIGHT_TOL.get(name, 1e-5), f"{key}: relative weight difference {err:.2e}"
    level = _zero_level(overrides)
    for r in results:
        m = r["memory"]
        total_bytes = m["total_elements"] * 4  # fp32 weights and gradients
        if level >= 1:  # every rank holds optimizer state for 1/dp of the parameters (+ its share of the padding)
            assert m["optimizer_state_bytes"] == m["expected_state_bytes"] > 0
            assert m["owned_elements"] * dp <= m["total_elements"]
            assert m["owned_elements"] * dp >= m["total_elements"] - m["padding_elements"] - 0
        # ZeRO-2 keeps only the owned chunk of the gradients between steps, ZeRO-3 also of the weights
        assert m["grad_bytes"] * (dp if level >= 2 else 1) == total_bytes, (level, m)
        assert m["weight_bytes"] * (dp if level == 3 else 1) == total_bytes, (level, m)


def _zero_level(overrides: list[str]) -> int:
    for o in overrides:
        if o.startswith("parallel.zero="):
            return int(o.split("=")[1])
    return 1 if "parallel.zero1=true" in overrides else 0
