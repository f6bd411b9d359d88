"""Preference training (DPO, IPO, ORPO, SimPO) through the real trainer on preference rows.

The loss of a step is the mean over every pair of the global batch (and ORPO's NLL term the mean
over every chosen token), so it must not depend on the layout: one process equals TP=2 x DP=2
(DPO against a frozen reference) and PP=2 x DP=2 (ORPO, SimPO: the loss computed on the last
stage from its logits), fp32, over several steps. With LoRA the reference is the policy with its
adapters off (in one process, and at PP=2 x DP=2 where the reference pass runs through the
pipeline: slow) or a frozen copy (one process): both give the same losses, and at step 0
(adapters start at zero, so policy = reference) the DPO loss is exactly log 2. A whole IPO run
writes the pair metrics to metrics.jsonl. Bad combinations are refused before launch.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from chat_task import task_with_tokenizer
from distributed import run_distributed
from plait.config import RecipeError, check_recipe
from trainer_runs import max_relative

STEPS = 6


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_with_tokenizer(tmp_path_factory.mktemp("preference"), seed=3, train=120, heldout=10)


def _items(root, objective: str, extra: list[str]) -> list[str]:
    return ["data.format=preference", f"train.objective={objective}", f"data.tokenizer={root / 'tokenizer.json'}",
            # 420 tokens hold two or three pairs of the task: micro-batches have different pair counts
            "data.seq_len=420", "data.val_fraction=0.1", "model.hidden_size=64", "model.num_hidden_layers=2",
            "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.intermediate_size=128",
            "model.max_position_embeddings=420", f"data.cache_dir={root / 'cache'}", "precision.preset=fp32",
            "optimizer.lr=3e-3",
            "scheduler.warmup_steps=0", f"train.steps={STEPS}", "logging.progress_bar=false", "parallel.tp=1",
            "parallel.sequence_parallel=false", "train.eval_batches=1", *extra]


def _worker(rank, world, recipe_yaml, prepared, steps, fit):
    from plait.config import validate_recipe
    from plait.train.objectives import PreferenceObjective
    from plait.train.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    if fit:
        return {"fit": trainer.fit()}
    batches, losses, pairs = iter(trainer.run.loader), [], []
    for _ in range(steps):
        trainer.run_step(next(batches))
        losses.append(trainer.run.metrics.read(average_over=trainer.state.dp, loss_from=trainer.state.pp)["loss"])
        objective = trainer.state.objective
        assert isinstance(objective, PreferenceObjective)
        head = objective.head
        pairs.append(head.read("train", trainer.state.pp, trainer.state.dp))
    trainer.run.loader.close()
    rows = trainer.state.train_data.row_pairs
    return {"losses": losses, "pairs": pairs, "eval": trainer.evaluate(),
            "pairs_per_row": sorted({int(n) for n in rows}) if rows is not None else []}


def _run(task, tmp_path, objective: str, extra: list[str], world: int, fit: bool = False,
         steps: int = STEPS) -> list[dict]:
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    root, paths = task
    items = _items(root, objective, extra) + [f"data.source={paths['preference_train']}",
                                              f"run.output_dir={tmp_path}", f"train.steps={steps}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    return run_distributed(_worker, world, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared, steps,
                           fit)


SINGLE = ["data.micro_batch_size=2", "parallel.microbatches=2"]
TP_DP = ["parallel.tp=2", "parallel.dp=2", "data.micro_batch_size=1", "parallel.microbatches=2",
         "parallel.sequence_parallel=true"]
PP_DP = ["parallel.pp=2", "parallel.dp=2", "data.micro_batch_size=1", "parallel.microbatches=2"]
LORA = ["lora.rank=4", "lora.alpha=8.0", "lora.target_modules=[q_proj,v_proj,down_proj]"]


def _last_stage(results: list[dict]) -> dict:
    return next(r for r in results if any(r["losses"]))


def test_dpo_with_a_frozen_reference_is_the_same_under_tp_dp(task, tmp_path):
    single = _run(task, tmp_path / "one", "dpo", SINGLE, 1, steps=10)[0]
    assert len(single["pairs_per_row"]) > 1, single["pairs_per_row"]  # a per-micro-batch mean would differ
    assert single["losses"][0] == pytest.approx(math.log(2), rel=1e-6)  # policy = reference at step 0
    assert single["losses"][-1] < single["losses"][0]  # it learns
    for key in ("rewards/chosen", "rewards/margin", "rewards/accuracy", "logps/chosen", "logps/rejected"):
        assert key in single["pairs"][-1]
    assert single["pairs"][0]["rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    assert {"val_loss", "val_rewards/accuracy"} <= set(single["eval"])
    tp_dp = _run(task, tmp_path / "tp", "dpo", TP_DP, 4, steps=10)
    assert max_relative(tp_dp[0]["losses"], single["losses"]) < 1e-5, (tp_dp[0]["losses"], single["losses"])
    assert tp_dp[0]["eval"]["val_loss"] == pytest.approx(single["eval"]["val_loss"], rel=1e-5)
    assert tp_dp[0]["pairs"][-1]["rewards/margin"] == pytest.approx(single["pairs"][-1]["rewards/margin"],
                                                                    rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("objective, extra", [
    ("orpo", []),
    pytest.param("simpo", ["preference.beta=2.0", "preference.gamma=0.5"], marks=pytest.mark.slow),
])
def test_reference_free_objectives_are_the_same_under_pp_dp(task, tmp_path, objective, extra):
    single = _run(task, tmp_path / "one", objective, SINGLE + extra, 1)[0]
    assert single["losses"][-1] < single["losses"][0]
    pp_dp = _last_stage(_run(task, tmp_path / "pp", objective, PP_DP + extra, 4))
    assert max_relative(pp_dp["losses"], single["losses"]) < 1e-5, (pp_dp["losses"], single["losses"])
    assert pp_dp["eval"]["val_loss"] == pytest.approx(single["eval"]["val_loss"], rel=1e-5)
    if objective == "orpo":
        assert pp_dp["pairs"][-1]["loss/nll"] == pytest.approx(single["pairs"][-1]["loss/nll"], rel=1e-5)


@pytest.mark.slow
def test_lora_dpo_reference_adapters_off_under_pp_dp_equals_a_frozen_copy(task, tmp_path):
    """(The one-process case is part of the precompute test below.)"""
    frozen = _run(task, tmp_path / "frozen", "dpo", LORA + SINGLE + ["preference.reference=frozen"], 1)[0]
    off = _last_stage(_run(task, tmp_path / "off", "dpo", LORA + PP_DP + ["preference.reference=adapters_off"], 4))
    assert off["losses"][0] == pytest.approx(math.log(2), rel=1e-6)
    assert off["losses"][-1] < off["losses"][0]
    assert max_relative(off["losses"], frozen["losses"]) < 1e-5, (off["losses"], frozen["losses"])


def _tables(task) -> list:
    root, _ = task
    return sorted((root / "cache").rglob("reference/*/*.npy"))


@pytest.mark.slow  # 17 s: three LoRA DPO runs; the default suite checks each reference mode's loss elsewhere
def test_lora_dpo_references_adapters_off_frozen_and_precompute_give_the_same_losses(task, tmp_path):
    """On a LoRA run the three reference modes are the same initial model: adapters_off (no second
    copy), frozen (a second copy) and precompute (scored once, stored with the prepared rows and
    reused by a second run with other micro-batches; a table scored under PP x DP: the slow test
    below) give the same losses."""
    for table in _tables(task):  # another test of this module may have left one: start without
        table.unlink()
    frozen = _run(task, tmp_path / "frozen", "dpo", LORA + SINGLE + ["preference.reference=frozen"], 1)[0]
    off = _run(task, tmp_path / "off", "dpo", LORA + SINGLE + ["preference.reference=adapters_off"], 1)[0]
    assert off["losses"][-1] < off["losses"][0]
    assert max_relative(off["losses"], frozen["losses"]) < 1e-5, (off["losses"], frozen["losses"])
    first = _run(task, tmp_path / "pre", "dpo", LORA + SINGLE + ["preference.reference=precompute"], 1)[0]
    tables = _tables(task)
    assert [t.name for t in tables] == ["train.npy", "val.npy"], tables
    assert first["losses"][0] == pytest.approx(math.log(2), rel=1e-6)
    assert max_relative(first["losses"], frozen["losses"]) < 1e-6, (first["losses"], frozen["losses"])
    assert first["eval"]["val_loss"] == pytest.approx(frozen["eval"]["val_loss"], rel=1e-6)
    written = [t.stat().st_mtime_ns for t in tables]
    other_layout = ["data.micro_batch_size=1", "parallel.microbatches=4"]  # same global batch, other micro-batches
    again = _run(task, tmp_path / "again", "dpo", LORA + other_layout + ["preference.reference=precompute"], 1)[0]
    assert [t.stat().st_mtime_ns for t in _tables(task)] == written, "the stored table is reused, not rewritten"
    assert max_relative(again["losses"], frozen["losses"]) < 1e-5, (again["losses"], frozen["losses"])


@pytest.mark.slow
def test_dpo_precompute_under_pp_dp_scores_the_same_table(task, tmp_path):
    """Computed by a PP=2 x DP=2 layout (last stage fills its DP share, padded last batch) the table
    equals the one-process table to float32 round-off."""
    import numpy as np

    for table in _tables(task):
        table.unlink()
    _run(task, tmp_path / "one", "dpo", SINGLE + ["preference.reference=precompute"], 1, steps=1)
    one = {t.name: np.load(t) for t in _tables(task)}
    for table in _tables(task):
        table.unlink()
    _run(task, tmp_path / "pp", "dpo", PP_DP + ["preference.reference=precompute"], 4, steps=1)
    pp = {t.name: np.load(t) for t in _tables(task)}
    assert one.keys() == pp.keys() == {"train.npy", "val.npy"}
    for name in one:
        np.testing.assert_allclose(pp[name], one[name], rtol=1e-5, atol=1e-4)


def test_ipo_run_writes_pair_metrics_to_metrics_jsonl(task, tmp_path):
    """The whole loop (fit): pair metrics and validation metrics reach metrics.jsonl."""
    import json

    results = _run(task, tmp_path, "ipo", SINGLE + ["train.log_every=3", "train.eval_every=6"], 1, fit=True)
    assert results[0]["fit"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
                "logps/rejected"):
        assert all(math.isfinite(r[key]) for r in records), key
    assert math.isfinite(records[-1]["val_loss"]) and 0 <= records[-1]["val_rewards/accuracy"] <= 1


@pytest.mark.parametrize("items, field", [
    (["data.format=preference", "train.objective=sft"], "train.objective"),
    (["data.format=sft", "train.objective=dpo"], "train.objective"),
    (["train.objective=orpo", "preference.reference=frozen"], "preference.reference"),
    (["train.objective=dpo", "preference.reference=adapters_off"], "preference.reference"),
    (["train.objective=ipo", "preference.label_smoothing=0.1"], "preference.label_smoothing"),
    (["train.objective=dpo", "preference.gamma=0.5"], "preference.gamma"),
    (["data.format=sft", "train.objective=sft", "preference.beta=0.5"], "preference.beta"),
])
def test_bad_preference_recipes_are_refused_before_launch(task, items, field):
    root, paths = task
    base = ["data.format=preference", f"data.tokenizer={root / 'tokenizer.json'}",
            f"data.source={paths['preference_train']}"]
    with pytest.raises(RecipeError) as err:
        check_recipe(None, base + items)
    assert field in err.value.fields, str(err.value)


def test_qlora_dpo_frozen_reference_is_the_quantized_base(task, tmp_path):
    """With a quantized base the frozen reference is quantized the same way, so it is the policy
    with its adapters off: step 0 is exactly log 2 and the losses equal adapters_off's."""
    qlora = LORA + SINGLE + ["lora.quantize_base=nf4", "lora.quantize_block_size=16"]
    frozen = _run(task, tmp_path / "frozen", "dpo", qlora + ["preference.reference=frozen"], 1)[0]
    off = _run(task, tmp_path / "off", "dpo", qlora + ["preference.reference=adapters_off"], 1)[0]
    assert frozen["losses"][0] == pytest.approx(math.log(2), rel=1e-6)
    assert max_relative(frozen["losses"], off["losses"]) < 1e-6, (frozen["losses"], off["losses"])
