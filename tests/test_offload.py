"""Optimizer offload (``parallel.offload_optimizer``): the fp32 master weights and AdamW moments in
host memory, updated there.

The host update runs the same fused AdamW on the same fp32 values as the update on the device, so
a run with offload must equal the run without it bitwise (losses, gradient norms, final weights)
at every ZeRO level; on this CPU-only machine the host and the device are the same memory, so the
tests prove the separate master, the gradient copies and the write-back, not the transfer speed.
"""

from __future__ import annotations

import pytest
import torch

from plait.config import RecipeError, validate_recipe
from trainer_runs import corpus_dir, run_recipe

BASE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
        "data.micro_batch_size=2", "parallel.sequence_parallel=false", "optimizer.grad_clip=0.5",
        "scheduler.warmup_steps=1", "optimizer.lr=3e-3", "parallel.tp=1", "logging.progress_bar=false",
        "logging.tensorboard=false", "parallel.bucket_mb=0.05"]
STEPS = 4

#: name: (overrides, world)
CASES = {
    "one-process": ([], 1),
    "dp2-zero3": (["parallel.dp=2", "parallel.zero=3"], 2),
    "dp2-zero1-bf16-mixed": pytest.param((["parallel.dp=2", "parallel.zero=1", "precision.preset=bf16-mixed"], 2),
                                         marks=pytest.mark.slow),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


@pytest.mark.parametrize("name", [pytest.param(n, marks=getattr(v, "marks", ())) for n, v in CASES.items()])
def test_offload_equals_the_update_on_the_device(corpus, tmp_path, name):
    value = CASES[name]
    overrides, world = value.values[0] if hasattr(value, "values") else value
    runs = {off: run_recipe(corpus, tmp_path / f"offload-{off}",
                            BASE + overrides + [f"parallel.offload_optimizer={str(off).lower()}"], world, STEPS)
            for off in (False, True)}
    for ref, got in zip(runs[False], runs[True], strict=True):
        assert ref["losses"][-1] < ref["losses"][0], "the run must learn for the comparison to mean anything"
        assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
        assert set(got["weights"]) == set(ref["weights"])
        for k, t in ref["weights"].items():
            assert torch.equal(got["weights"][k], t), k
        m, m0 = got["memory"], ref["memory"]
        assert m0["host_bytes"] == 0
        # the moments, the master and the host copy of the owned gradients (fp32, the master's size)
        assert m["host_bytes"] == m["optimizer_state_bytes"] + 2 * m["master_bytes"]
        assert m["master_bytes"] > 0, "the fp32 master lives apart from the device weights"


def test_bf16_pure_is_refused_with_offload():
    with pytest.raises(RecipeError) as err:
        validate_recipe({"parallel": {"offload_optimizer": True}, "precision": {"preset": "bf16-pure"}}, 1)
    assert "parallel.offload_optimizer" in str(err.value) and "bf16-mixed" in str(err.value)
    validate_recipe({"parallel": {"offload_optimizer": True}, "precision": {"preset": "bf16-mixed"}}, 1)


def _llama_8b():
    from plait.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)


def test_the_planner_moves_the_states_to_the_host_and_prices_the_traffic():
    from plait.devices import DEVICES
    from plait.plan.degrees import ParallelDegrees
    from plait.plan.memory import estimate_memory
    from plait.plan.timing import HOST_UPDATE_BW, HOST_UPDATE_BYTES, estimate_step_time

    config = _llama_8b()
    kw = {"precision": "bf16-mixed", "micro_batch_size": 1, "seq_len": 2048, "microbatches": 8}
    for zero in (0, 3):
        base = ParallelDegrees(dp=8, zero=zero, activation_checkpointing="full")
        off = ParallelDegrees(dp=8, zero=zero, activation_checkpointing="full", offload=True)
        m0, m1 = estimate_memory(config, base, **kw), estimate_memory(config, off, **kw)
        owned = m0.optimizer // 8  # two fp32 moments per owned element
        assert m1.optimizer == m1.master_weights == 0 and m0.host_bytes == 0
        assert m1.host_bytes == 16 * owned
        assert m1.total == m0.total - m0.optimizer - m0.master_weights
        t0, t1 = (estimate_step_time(config, lay, DEVICES["h100"], **kw) for lay in (base, off))
        expected = owned * (4 + 4) / DEVICES["h100"].host_link_bw + owned * HOST_UPDATE_BYTES / HOST_UPDATE_BW
        assert t1.offload_s == pytest.approx(expected, rel=1e-3)
        assert t1.total_s == pytest.approx(t0.total_s + t1.offload_s)


def test_the_search_tries_offload_when_asked_and_never_with_bf16_pure():
    from plait.plan.search import SearchOptions, rank_layouts

    config = _llama_8b()
    kw = {"micro_batch_size": 1, "seq_len": 2048, "global_batch_size": 64, "require_fit": False}
    asked = rank_layouts(config, 8, "h100", precision="bf16-mixed", options=SearchOptions(offload=(False, True)), **kw)
    assert any(c.layout.offload for c in asked.candidates)
    assert not any(c.layout.offload for c in rank_layouts(config, 8, "h100", precision="bf16-mixed", **kw).candidates)
    pure = rank_layouts(config, 8, "h100", precision="bf16-pure", options=SearchOptions(offload=(False, True)), **kw)
    assert not any(c.layout.offload for c in pure.candidates)


def test_a_dry_run_builds_the_host_states_on_meta_and_matches_the_model():
    from plait.models.llama import LlamaConfig
    from plait.plan.degrees import ParallelDegrees
    from plait.plan.dry_run import dry_run

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512)
    for zero in (1, 3):
        layout = ParallelDegrees(dp=4, zero=zero, offload=True)
        report = dry_run(config, layout, 4, 3, precision="bf16-mixed", seq_len=512)
        assert report.zero_built["host_bytes"] > 0 and report.zero_built["optimizer_state_bytes"] == 0
        assert report.zero_matches, report.zero_line()
