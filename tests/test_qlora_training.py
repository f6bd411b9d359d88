"""QLoRA through the real trainer: a quantized base gives one process's losses under TP and PP.

Every rank quantizes only the base weights it holds, in units tensor parallelism never cuts
(plait.quantize), so a TP=2 or PP=2 run trains on exactly the base one process trains on: their
losses over 20 steps equal one process's (fp32 compute, 1e-5 relative). The same run with the
base as read (plain LoRA) is the control: its losses differ, so the quantization is in effect.
"""

from __future__ import annotations

import pytest

from trainer_runs import corpus_dir, max_relative, run_recipe

STEPS = 20
QLORA = ["lora.rank=4", "lora.alpha=8.0",
         "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
         "lora.quantize_base=nf4", "lora.quantize_block_size=16", "optimizer.lr=5e-3"]
MODEL = ["model.hidden_size=64", "model.num_hidden_layers=4", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.intermediate_size=128", "data.seq_len=64", "data.micro_batch_size=2",
         "parallel.microbatches=2", "precision.preset=fp32", "scheduler.warmup_steps=0", f"train.steps={STEPS}",
         "logging.progress_bar=false", "parallel.tp=1", "parallel.sequence_parallel=false"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory) -> list[float]:
    return run_recipe(corpus, tmp_path_factory.mktemp("one"), MODEL + QLORA, 1, STEPS)[0]["losses"]


def _losses(results: list[dict]) -> list[float]:
    return next(r["losses"] for r in results if any(r["losses"]))


@pytest.mark.parametrize("layout,world", [
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2),
    (["parallel.pp=2"], 2),
], ids=["tp2-sp", "pp2"])
def test_qlora_20_steps_equal_one_process(corpus, one_process, tmp_path, layout, world):
    losses = _losses(run_recipe(corpus, tmp_path, MODEL + QLORA + layout, world, STEPS))
    assert one_process[-1] < one_process[0]
    assert max_relative(losses, one_process) < 1e-5, (losses, one_process)


def test_the_quantized_base_changes_the_losses(corpus, one_process, tmp_path):
    plain = run_recipe(corpus, tmp_path, MODEL + QLORA[:-3] + ["optimizer.lr=5e-3"], 1, STEPS)[0]["losses"]
    assert max_relative(plain, one_process) > 1e-4, "quantization had no effect"
    assert max_relative(plain, one_process) < 0.05, "the quantized base is far from the base"


def test_zero3_with_a_quantized_base_equals_zero1(corpus, tmp_path):
    """ZeRO-3 shards the embeddings, norms, head and adapters; the quantized base stays whole on
    each rank (a warning says so), and the losses are ZeRO-1's."""
    dp2 = ["parallel.dp=2", "data.micro_batch_size=1", "train.steps=6"]
    zero1 = _losses(run_recipe(corpus, tmp_path / "z1", MODEL + QLORA + dp2 + ["parallel.zero=1"], 2, 6))
    zero3 = _losses(run_recipe(corpus, tmp_path / "z3", MODEL + QLORA + dp2 + ["parallel.zero=3"], 2, 6))
    assert max_relative(zero3, zero1) < 1e-5, (zero3, zero1)
