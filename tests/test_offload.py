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
