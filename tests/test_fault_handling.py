"""Preemption signals and non-finite losses, through the real trainer (2 gloo ranks, fp32)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import yaml

from distributed import run_distributed
from trainer_runs import corpus_dir, train_then_sigterm

BASE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
        "parallel.sequence_parallel=false", "parallel.tp=1", "parallel.dp=2", "data.micro_batch_size=4",
        "scheduler.warmup_steps=1", "logging.progress_bar=false", "logging.tensorboard=false", "train.log_every=1",
        "train.eval_every=100", "train.steps=6", "checkpoint.save_final=false", "train.sample_tokens=0",
        "logging.plot=false"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


def _fit_worker(rank, world, recipe_yaml, prepared, signal_at, nan_at):
    """``fit()`` with rank 1 signalling itself after step ``signal_at`` or rank 0's loss NaN at ``nan_at``."""
    from plait.config import validate_recipe
    from plait.parallel_state import full_state_dict
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    run_step, weights = trainer.run_step, []
    calls = {"n": trainer.state.start_step}
    stage = trainer.state.stages[0]  # one stage: these runs have no pipeline parallelism
    forward = stage.forward

    def poisoned(*args, **kwargs):
        loss = forward(*args, **kwargs)
        return loss * float("nan") if calls["n"] + 1 == nan_at and rank == 0 else loss

    stage.forward = poisoned

    def step(batch):
        lr = run_step(batch)
        calls["n"] += 1
        with trainer.state.optimizer.weights_gathered():  # ZeRO-3 keeps only chunks between steps
            weights.append({k: v.clone() for k, v in full_state_dict(stage, trainer.state.tp).items()})
        if calls["n"] == signal_at and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return lr

    trainer.run_step = step
    try:
        final = trainer.fit()
        error = None
    except FloatingPointError as e:
        final, error = {}, str(e)
    return {"final": final, "weights": weights, "signal": getattr(trainer, "stopped_by_signal", 0), "error": error,
            "start": trainer.state.start_step}


def _run(corpus, out, items, signal_at=-1, nan_at=-1):
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = BASE + items + [f"data.source={corpus}", f"run.output_dir={out}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    return run_distributed(_fit_worker, 2, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared, signal_at,
                           nan_at)


@pytest.mark.parametrize("layout", [[], ["parallel.zero=3"]], ids=["dp2", "dp2-zero3"])
def test_sigterm_saves_a_checkpoint_exits_cleanly_and_resume_continues_exactly(corpus, tmp_path, layout):
    straight = _run(corpus, tmp_path / "straight", layout)
    stopped = _run(corpus, tmp_path / "stopped", layout, signal_at=3)
    assert [r["signal"] for r in stopped] == [signal.SIGTERM] * 2, "both ranks stop at the same step boundary"
    assert all(len(r["weights"]) == 3 for r in stopped)
    assert (tmp_path / "stopped" / "checkpoints" / "step-00000003" / "manifest.json").is_file()
    resumed = _run(corpus, tmp_path / "stopped", layout + ["checkpoint.resume=auto"])
    assert all(r["start"] == 3 for r in resumed)
    for r_straight, r_resumed in zip(straight, resumed, strict=True):
        for k, v in r_straight["weights"][-1].items():
            assert torch.equal(v, r_resumed["weights"][-1][k]), k
        assert r_resumed["final"]["loss"] == r_straight["final"]["loss"]


def test_nonfinite_loss_skip_discards_the_step(corpus, tmp_path):
    results = _run(corpus, tmp_path / "skip", ["train.nonfinite=skip"], nan_at=3)
    for r in results:
        assert r["error"] is None and len(r["weights"]) == 6
        before, skipped = r["weights"][1], r["weights"][2]
        for k in before:
            assert torch.equal(before[k], skipped[k]), f"step 3 changed {k}"
            assert torch.isfinite(r["weights"][-1][k]).all()
        assert not all(torch.equal(r["weights"][3][k], skipped[k]) for k in before), "training goes on after"


def test_nonfinite_loss_halt_stops_before_any_checkpoint_of_it(corpus, tmp_path):
    results = _run(corpus, tmp_path / "halt", ["train.nonfinite=halt", "checkpoint.save_every=1",
                                                "checkpoint.keep=10"], nan_at=3)
    for r in results:
        assert r["error"] is not None and "non-finite" in r["error"] and "no checkpoint was written" in r["error"]
    steps = sorted(p.name for p in (tmp_path / "halt" / "checkpoints").iterdir())
    assert steps == ["step-00000001", "step-00000002"]


def _stall_worker(rank, world, recipe_yaml, prepared):
    import time

    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    messages = []
    trainer.run.watchdog.on_stall = messages.append  # the default prints the message and exits with status 3
    batches = iter(trainer.run.loader)
    for step in range(3):
        if rank == 1 and step == 1:
            time.sleep(3.0)  # a rank that stops answering (stuck data loader, dead peer, ...)
        trainer.run_step(next(batches))
    trainer.run.loader.close()
    trainer.run.watchdog.close()
    return messages


def test_watchdog_names_the_rank_group_and_operation_of_a_stall(corpus, tmp_path):
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = BASE + ["train.stall_timeout_s=1", f"data.source={corpus}", f"run.output_dir={tmp_path}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    messages = run_distributed(_stall_worker, 2, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared)
    assert messages[1] == [], messages
    assert len(messages[0]) == 1, messages
    msg = messages[0][0]
    assert msg.startswith("plait watchdog: rank 0 stalled for ") and "at step 2" in msg, msg
    assert "data-parallel gradient reduction (group dp, ranks [0, 1])" in msg, msg


def test_watchdog_default_action_exits_with_status_3():
    import subprocess
    import sys

    code = ("import time\nfrom plait.train.watchdog import Watchdog\nw = Watchdog(0.3, 5)\n"
            "with w.watch('pipeline schedule', 'group pp, ranks [1, 5]'):\n    time.sleep(5)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert "rank 5 stalled for" in proc.stderr and "pipeline schedule (group pp, ranks [1, 5])" in proc.stderr


@pytest.mark.slow  # two `plait train` launches: `make test-slow`
def test_plait_train_exits_0_on_sigterm_and_resumes(corpus, tmp_path):
    """Preemption through the real command: SIGTERM to `plait train` (the local launcher) gives a
    checkpoint and exit status 0; the next `plait train ... checkpoint.resume=auto` continues from it."""
    import subprocess
    import sys

    from plait.checkpoint.store import latest_checkpoint

    items = BASE + [f"data.source={corpus}", f"run.output_dir={tmp_path}", "train.eval_every=100000"]
    cmd = [sys.executable, "-m", "plait.cli", "train", *items]
    returncode, out = train_then_sigterm(cmd + ["train.steps=100000"], tmp_path / "metrics.jsonl")
    assert returncode == 0, out
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt is not None, out
    step = int(ckpt.name.split("-")[1])
    resumed = subprocess.run(cmd + [f"train.steps={step + 2}", "checkpoint.resume=auto"], capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {ckpt} at step {step}" in resumed.stdout
