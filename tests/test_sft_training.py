"""Supervised fine-tuning through the real trainer: packed chat rows, loss on assistant tokens only.

The loss of a step is the sum of the target tokens' losses divided by the global batch's target
count, so it must not depend on the layout: one process equals TP=2 x DP=2 and PP=2 x DP=2 over
several steps (fp32). LoRA trains only its adapters and matches one process at TP=2 x DP=2 too.
Bad combinations of format, objective and tokenizer are refused before anything starts.
"""

from __future__ import annotations

import pytest

from chat_task import task_with_tokenizer
from plait.config import RecipeError, check_recipe
from trainer_runs import max_relative, run_recipe

STEPS = 6


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_with_tokenizer(tmp_path_factory.mktemp("sft"), seed=3, train=120, heldout=10)


def _items(root, extra: list[str]) -> list[str]:
    return ["data.format=sft", "train.objective=sft", f"data.tokenizer={root / 'tokenizer.json'}",
            "data.seq_len=256", "data.val_fraction=0.1", "model.hidden_size=64", "model.num_hidden_layers=4",
            "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.intermediate_size=128",
            "model.max_position_embeddings=256", "precision.preset=fp32", "optimizer.lr=3e-3",
            "scheduler.warmup_steps=0", f"train.steps={STEPS}", "logging.progress_bar=false", "parallel.tp=1",
            "parallel.sequence_parallel=false", *extra]


def _run(task, tmp_path, extra: list[str], world: int) -> list[dict]:
    root, paths = task
    return run_recipe(paths["sft_train"], tmp_path, _items(root, extra), world, STEPS)


def _losses(task, tmp_path, extra: list[str], world: int) -> list[list[float]]:
    return [r["losses"] for r in _run(task, tmp_path, extra, world)]


def _adapter_elements(hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int, rank: int,
                      tp: int = 1) -> int:
    """Adapter elements one rank holds for targets q, v (column-parallel: B split) and down
    (row-parallel: A split): A is [rank, in], B is [out, rank]."""
    head_dim = hidden // heads
    q = rank * hidden + hidden * rank // tp
    v = rank * hidden + kv_heads * head_dim * rank // tp
    down = rank * intermediate // tp + hidden * rank
    return layers * (q + v + down)


@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.dp=2", "data.micro_batch_size=1", "parallel.microbatches=2",
     "parallel.sequence_parallel=true"],
    # packed rows under PP also run by default in tests/test_packing_equivalence.py
    pytest.param(["parallel.pp=2", "parallel.dp=2", "data.micro_batch_size=1", "parallel.microbatches=2"],
                 marks=pytest.mark.slow)], ids=["tp2xdp2-sp", "pp2xdp2"])
def test_sft_loss_is_the_same_under_tp_dp_and_pp_dp(task, tmp_path, layout):
    single = _losses(task, tmp_path / "one", ["data.micro_batch_size=2", "parallel.microbatches=2"], 1)[0]
    assert single[-1] < single[0]  # it learns
    last_stage = [losses for losses in _losses(task, tmp_path / "layout", layout, 4) if any(losses)]
    assert max_relative(last_stage[0], single) < 1e-5, (last_stage[0], single)


def test_lora_sft_trains_only_adapters_and_matches_under_tp_dp(task, tmp_path):
    lora = ["lora.rank=4", "lora.alpha=8.0", "lora.target_modules=[q_proj,v_proj,down_proj]"]
    one = _run(task, tmp_path / "one", lora + ["data.micro_batch_size=2", "parallel.microbatches=2"], 1)[0]
    tp_dp = _run(task, tmp_path / "tp", lora + ["parallel.tp=2", "parallel.dp=2", "data.micro_batch_size=1",
                                                "parallel.microbatches=2"], 4)
    single = one["losses"]
    assert single[-1] < single[0]
    assert max_relative(tp_dp[0]["losses"], single) < 1e-5, (tp_dp[0]["losses"], single)
    # the optimizer holds AdamW's two fp32 moments for the adapters only (measured on each rank)
    full = _adapter_elements(64, 4, 2, 128, 4, rank=4)
    assert one["memory"]["optimizer_state_bytes"] == 2 * 4 * full
    for r in tp_dp:
        assert r["memory"]["optimizer_state_bytes"] == 2 * 4 * _adapter_elements(64, 4, 2, 128, 4, rank=4, tp=2)


@pytest.mark.parametrize("items, field", [
    (["data.format=sft"], "train.objective"),
    (["train.objective=sft"], "train.objective"),
    (["data.format=sft", "train.objective=sft"], "data.tokenizer"),
])
def test_format_objective_and_tokenizer_are_checked_before_launch(task, items, field):
    _, paths = task
    with pytest.raises(RecipeError) as err:
        check_recipe(None, [f"data.source={paths['sft_train']}", *items])
    assert field in err.value.fields, str(err.value)


def test_sft_source_must_be_a_row_file_not_a_directory(task):
    root, _ = task
    with pytest.raises(RecipeError, match="is a directory; name its row files with a glob"):
        check_recipe(None, ["data.format=sft", "train.objective=sft", f"data.source={root}",
                            f"data.tokenizer={root / 'tokenizer.json'}"])


@pytest.mark.slow
def test_lora_sft_20_steps_tp2_pp2_equals_one_process(task, tmp_path):
    """20 steps of LoRA SFT at TP=2 x PP=2 follow one process (the adapters' own parallel layout
    and the pipeline together)."""
    lora = ["lora.rank=4", "lora.alpha=8.0", "lora.target_modules=[q_proj,v_proj,o_proj,down_proj]",
            "train.steps=20", "data.micro_batch_size=2", "parallel.microbatches=2"]
    root, paths = task
    single = run_recipe(paths["sft_train"], tmp_path / "one", _items(root, lora), 1, 20)[0]["losses"]
    both = run_recipe(paths["sft_train"], tmp_path / "tp", _items(root, lora + ["parallel.tp=2", "parallel.pp=2"]),
                      4, 20)
    losses = next(r["losses"] for r in both if any(r["losses"]))
    assert single[-1] < single[0]
    assert max_relative(losses, single) < 1e-5, (losses, single)
