"""Resuming post-training runs: LoRA SFT, LoRA DPO (reference adapters_off and precompute) and
full DPO (a frozen reference), stopped by SIGTERM and continued with ``checkpoint.resume=auto``.

A LoRA checkpoint holds the adapters only (the base comes back from where the run read it), and
every checkpoint records what it holds; a resume must give the unbroken run's per-step losses
and trained weights bit for bit under the same layout, and within 1e-5 (relative) under another
layout. A recipe that cannot continue the checkpoint (LoRA switched on or off, another alpha,
another base) is refused before launch by ``plait train``, naming the setting and the fix.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import yaml

from chat_task import task_with_tokenizer
from distributed import run_distributed
from plait.cli import main
from trainer_runs import max_relative

STEPS, STOP_AT = 6, 3
LORA = ["lora.rank=4", "lora.alpha=8.0", "lora.target_modules=[q_proj,v_proj,down_proj]"]
#: name -> (format/objective items, source key of the task files)
MODES = {
    "lora-sft": (["data.format=sft", "train.objective=sft", *LORA], "sft_train"),
    # QLoRA: the checkpoint holds the adapters; the resumed run quantizes the base again, to the same values
    "qlora-sft": (["data.format=sft", "train.objective=sft", *LORA, "lora.quantize_base=nf4",
                   "lora.quantize_block_size=16"], "sft_train"),
    "lora-dpo-adapters_off": (["data.format=preference", "train.objective=dpo", "preference.reference=adapters_off",
                               *LORA], "preference_train"),
    "lora-dpo-precompute": (["data.format=preference", "train.objective=dpo", "preference.reference=precompute",
                             *LORA], "preference_train"),
    "full-dpo-frozen": (["data.format=preference", "train.objective=dpo", "preference.reference=frozen"],
                        "preference_train"),
}
DP2 = ["parallel.dp=2", "data.micro_batch_size=1", "parallel.microbatches=2"]
TP2 = ["parallel.tp=2", "data.micro_batch_size=2", "parallel.microbatches=2"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_with_tokenizer(tmp_path_factory.mktemp("resume"), seed=5, train=80, heldout=4)


def _items(task, mode: str, out, layout: list[str]) -> list[str]:
    root, paths = task
    extra, source = MODES[mode]
    return [*extra, f"data.source={paths[source]}", f"data.tokenizer={root / 'tokenizer.json'}",
            f"data.cache_dir={root / 'cache'}", f"run.output_dir={out}", "data.seq_len=384", "data.val_fraction=0.1",
            "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=4",
            "model.num_key_value_heads=2", "model.intermediate_size=128", "model.max_position_embeddings=384",
            "precision.preset=fp32", "optimizer.lr=3e-3", "scheduler.warmup_steps=1", f"train.steps={STEPS}",
            "train.log_every=1", "train.eval_every=100", "train.sample_tokens=0", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.plot=false", "checkpoint.async_save=false",
            "parallel.tp=1", "parallel.sequence_parallel=false", *layout]


def _fit_worker(rank, world, recipe_yaml, prepared, signal_at):
    """``fit()``, the last rank sending itself SIGTERM after step ``signal_at``; the trained
    parameters (gathered over TP) after it."""
    from plait.config import validate_recipe
    from plait.parallel_state import full_state_dict
    from plait.train.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    run_step, done = trainer.run_step, {"n": trainer.state.start_step}

    def step(batch):
        lr = run_step(batch)
        done["n"] += 1
        if done["n"] == signal_at and rank == world - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return lr

    trainer.run_step = step
    trainer.fit()
    trained = set()
    for stage in trainer.state.stages:
        trained |= {name for name, p in stage.named_parameters() if p.requires_grad}
    weights = {}
    for stage in trainer.state.stages:
        weights.update({k: v for k, v in full_state_dict(stage, trainer.state.tp).items() if k in trained})
    return {"start": trainer.state.start_step, "signal": trainer.stopped_by_signal, "weights": weights}


def _run(task, mode: str, out, layout: list[str], world: int, signal_at: int = -1, extra: tuple = ()) -> list[dict]:
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = _items(task, mode, out, layout) + list(extra)
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    return run_distributed(_fit_worker, world, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared,
                           signal_at)


def _losses(out) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def _stop_and_resume(task, mode, out, layout, world, resume_layout=None, resume_world=None) -> list[dict]:
    stopped = _run(task, mode, out, layout, world, signal_at=STOP_AT)
    assert [r["signal"] for r in stopped] == [signal.SIGTERM] * world
    manifest = json.loads((out / "checkpoints" / f"step-{STOP_AT:08d}" / "manifest.json").read_text())
    assert manifest["contents"]["model"] == ("adapters" if "lora" in mode else "full")
    resumed = _run(task, mode, out, resume_layout or layout, resume_world or world, extra=("checkpoint.resume=auto",))
    assert all(r["start"] == STOP_AT for r in resumed)
    return resumed


#: about 14 s each on 2 cores: LoRA SFT runs by default, the rest with `make test-slow`
SLOW_MODES = {"lora-dpo-adapters_off", "lora-dpo-precompute", "full-dpo-frozen"}


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_MODES else m for m in MODES])
def test_sigterm_then_resume_equals_the_unbroken_run(task, tmp_path, mode):
    straight = _run(task, mode, tmp_path / "straight", DP2, 2)
    resumed = _stop_and_resume(task, mode, tmp_path / "split", DP2, 2)
    assert _losses(tmp_path / "split") == _losses(tmp_path / "straight")
    assert len(_losses(tmp_path / "straight")) == STEPS
    weights, reference = resumed[0]["weights"], straight[0]["weights"]
    assert set(weights) == set(reference) and weights
    if "lora" in mode:
        assert all(".lora." in name for name in weights), "only the adapters train"
    for name, ref in reference.items():
        assert torch.equal(weights[name], ref), name


@pytest.mark.parametrize("mode", [pytest.param("lora-sft", marks=pytest.mark.slow), "lora-dpo-adapters_off"])
def test_lora_checkpoint_resumes_under_another_layout(task, tmp_path, mode):
    _run(task, mode, tmp_path / "straight", DP2, 2)
    _stop_and_resume(task, mode, tmp_path / "split", DP2, 2, resume_layout=TP2, resume_world=2)
    straight, split = _losses(tmp_path / "straight"), _losses(tmp_path / "split")
    assert split[:STOP_AT] == straight[:STOP_AT]
    assert max_relative(split, straight) <= 1e-5


def test_recipes_that_cannot_continue_a_lora_checkpoint_are_refused_before_launch(task, tmp_path, capsys):
    out = tmp_path / "run"
    _run(task, "lora-sft", out, [], 1, signal_at=STOP_AT)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    base = _items(task, "lora-sft", out, []) + ["checkpoint.resume=auto"]
    cases = {"lora.rank=null": "set lora.rank=4", "lora.alpha=2.0": "set lora.alpha=8.0",
             "run.seed=7": "set run.seed=0", "lora.target_modules=[q_proj]": "lora.target_modules",
             "model.hidden_size=128": "set model.hidden_size=64",
             "lora.quantize_base=nf4": "set lora.quantize_base=none"}
    for override, needle in cases.items():
        items = [i for i in base if not i.startswith("lora.")] if override == "lora.rank=null" else base
        assert main(["train", *items, override, "--nproc", "1"]) == 2, override
        err = capsys.readouterr().err
        assert "cannot continue this recipe" in err and needle in err, (override, err)
        assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before, "nothing written by a refused run"
    # an adapters-only checkpoint is no Hugging Face model: convert names the adapter and --merge-lora
    assert main(["convert", str(out / "checkpoints"), str(tmp_path / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds a LoRA run's adapters" in err and "--merge-lora" in err, err
    assert not (tmp_path / "hf").exists()


def test_whole_model_checkpoint_refused_by_a_lora_recipe(task, tmp_path, capsys):
    out = tmp_path / "run"
    _run(task, "full-dpo-frozen", out, [], 1, signal_at=STOP_AT)
    items = _items(task, "full-dpo-frozen", out, []) + ["checkpoint.resume=auto", *LORA]
    assert main(["train", *items, "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds a whole model trained without LoRA" in err and "lora.rank=null" in err, err


def _logits_worker(rank, world, recipe_yaml, prepared, ids):
    """The logits of ``ids`` from the run resumed at its last checkpoint (base as built + adapters)."""
    from plait.config import validate_recipe
    from plait.pipeline.stages_lm import StagesCausalLM
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    trainer.run.loader.close()
    with torch.no_grad():
        return StagesCausalLM(trainer.state.stages, trainer.state.mesh)(ids)


@pytest.mark.parametrize("mode", ["lora-sft", "qlora-sft"])
def test_a_lora_run_on_a_random_base_writes_that_base_into_its_adapter(task, tmp_path, mode):
    """The adapter, its base and (QLoRA) the record of the base's quantization: the scoring model
    read from the directory computes what the trained run computes."""
    from plait.heldout import load_scoring_model

    out = tmp_path / "run"
    items = _items(task, mode, out, []) + ["checkpoint.save_every=6"]
    assert main(["train", *items, "--nproc", "1"]) == 0
    final = out / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((final / "base").absolute())
    assert (final / "base" / "config.json").is_file() and (final / "base" / "tokenizer.json").is_file()
    if mode == "qlora-sft":
        record = json.loads((final / "base_quantization.json").read_text())
        assert (record["method"], record["block_size"], record["rounded_to"]) == ("nf4", 16, "float32")
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    model, _ = load_scoring_model(final)
    with torch.no_grad():
        from_dir = model(ids)
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    resumed = items + ["checkpoint.resume=auto"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, resumed)))
    trained = run_distributed(_logits_worker, 1, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, resumed)), prepared,
                              ids)[0]
    assert torch.allclose(from_dir, trained, rtol=1e-5, atol=1e-5), (from_dir - trained).abs().max()
