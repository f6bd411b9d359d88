"""Trainer edges: layout-free validation loss, the logged preempted step, the summary of a resumed
run, no sample for ``train.sample_tokens=0``, and a quiet clean stop of ``plait train``."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys

import pytest
import yaml

from distributed import run_distributed
from trainer_runs import corpus_dir, run_eval, train_then_sigterm

TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
        "parallel.sequence_parallel=false", "scheduler.warmup_steps=1", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.plot=false", "checkpoint.save_final=false", "precision.preset=fp32"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


# ---------------------------------------------------------------- validation loss (issue item 5)

#: layouts with one global batch of 8 sequences: (name, world, overrides)
EVAL_LAYOUTS = [
    ("single, 1 x 8", 1, ["parallel.tp=1", "parallel.dp=1", "data.micro_batch_size=8", "parallel.microbatches=1"]),
    ("single, 4 x 2", 1, ["parallel.tp=1", "parallel.dp=1", "data.micro_batch_size=2", "parallel.microbatches=4"]),
    ("dp=2", 2, ["parallel.tp=1", "parallel.dp=2", "data.micro_batch_size=4", "parallel.microbatches=1"]),
    ("tp=2", 2, ["parallel.tp=2", "parallel.dp=1", "data.micro_batch_size=8", "parallel.microbatches=1"]),
    ("pp=2, 2 x 4", 2, ["parallel.tp=1", "parallel.dp=1", "parallel.pp=2", "data.micro_batch_size=4",
                        "parallel.microbatches=2"]),
]


def test_validation_loss_is_the_same_under_every_layout(corpus, tmp_path):
    """Identical weights give one val_loss under TP, PP, DP and micro-batch splits of one global
    batch (fp32; 1e-6 relative allows the reordered sums inside TP matmuls, ~1e-7 here)."""
    values = {}
    for name, world, items in EVAL_LAYOUTS:
        per_rank = run_eval(corpus, tmp_path / name.replace(" ", "_"), TINY + items + ["train.eval_batches=2"], world)
        assert len(set(per_rank)) == 1, (name, per_rank)  # every rank reports the reduced value
        values[name] = per_rank[0]
    reference = values["single, 1 x 8"]
    for value in values.values():
        assert abs(value - reference) <= 1e-6 * abs(reference), values


def test_validation_indices_depend_on_the_global_batch_only():
    from plait.train.evaluation import rank_batches, validation_indices

    assert validation_indices(100, 8, 3) == list(range(24))
    assert validation_indices(20, 8, 3) == list(range(16))  # whole global batches only
    assert validation_indices(5, 8, 3) == [0, 1, 2, 3, 4, 0, 1, 2]  # shorter than one batch: wraps
    assert validation_indices(0, 8, 3) == []

    class Data:
        def __len__(self):
            return 100

        def __getitem__(self, i):
            import torch
            return torch.full((4,), i)

    class DP:
        def __init__(self, rank, size):
            self.rank, self.size = rank, size

    def seen(dp, microbatches, mbs):
        out = []
        for r in range(dp):
            for b in rank_batches(Data(), global_batch=8, batches=2, microbatches=microbatches,
                                  micro_batch_size=mbs, dp=DP(r, dp)):
                assert b.shape[:2] == (microbatches, mbs)
                out += b[..., 0].flatten().tolist()
        return sorted(out)

    assert seen(1, 1, 8) == seen(1, 4, 2) == seen(2, 1, 4) == seen(2, 2, 2) == seen(4, 2, 1) == list(range(16))


# ---------------------------------------------------------------- preemption and resume (issue item 6)

PREEMPT = TINY + ["parallel.tp=1", "parallel.dp=1", "data.micro_batch_size=4", "train.steps=6", "train.log_every=4",
                  "train.eval_every=100", "train.sample_tokens=0"]


def _fit_worker(rank, world, recipe_yaml, prepared, signal_at):
    """``fit()`` (signalling itself after step ``signal_at``), then ``finish()`` unless stopped; stdout of finish."""
    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    run_step, done = trainer.run_step, [trainer.state.start_step]

    def step(batch):
        lr = run_step(batch)
        done[0] += 1
        if done[0] == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the step boundary, like a preemption
        return lr

    trainer.run_step = step
    final = trainer.fit()
    out = io.StringIO()
    if not trainer.stopped_by_signal:
        with contextlib.redirect_stdout(out):
            trainer.finish(final)
    return {"final": final, "start": trainer.state.start_step, "stdout": out.getvalue()}


def _fit(corpus, out, items, signal_at=-1):
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = PREEMPT + items + [f"data.source={corpus}", f"run.output_dir={out}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    return run_distributed(_fit_worker, 1, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared, signal_at)[0]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_preempted_step_is_logged_and_a_resumed_run_reports_the_steps_it_trained(corpus, tmp_path):
    stopped = _fit(corpus, tmp_path, [], signal_at=3)
    assert stopped["final"]["stopped_by_signal"] == signal.SIGTERM
    assert (tmp_path / "checkpoints" / "step-00000003" / "manifest.json").is_file()
    records = _records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [3], "log_every=4: step 3 is logged only because it was preempted"
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert isinstance(records[0][key], float), key
    assert records[0]["stopped_by_signal"] == signal.SIGTERM

    # a record past the checkpoint (an attempt that logged after its last save) is trained again
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 9.0}) + "\n")
    resumed = _fit(corpus, tmp_path, ["checkpoint.resume=auto"])
    assert resumed["start"] == 3
    assert resumed["final"]["steps_trained"] == 3 and resumed["final"]["final_step"] == 6
    steps = [r["step"] for r in _records(tmp_path / "metrics.jsonl")]
    assert steps == [3, 4, 6], "the run's curve continues; the stale step-5 record is dropped"
    summary = (tmp_path / "summary.txt").read_text()
    rows = {line[:16].strip(): line[16:].strip() for line in summary.splitlines()[2:]}
    assert rows["final step"] == "6"
    assert rows["steps trained"] == "3 (resumed at step 3)"

    # train.sample_tokens=0: no sample header, no sample.txt
    assert "sample" not in resumed["stdout"], resumed["stdout"]
    assert "outputs in" in resumed["stdout"]
    assert not (tmp_path / "sample.txt").exists()


def test_summary_of_a_resumed_run_counts_only_its_own_steps(tmp_path):
    from plait.train.report import summarize, summary_table

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 10, "loss": 3.0, "tokens_per_s": 100.0, "elapsed_s": 50.0},  # the first attempt
            {"step": 15, "loss": 2.8, "tokens_per_s": 100.0, "elapsed_s": 75.0, "stopped_by_signal": 15},
            {"step": 20, "loss": 2.5, "tokens_per_s": 900.0, "elapsed_s": 4.0},  # resumed at 15
            {"step": 25, "loss": 2.0, "tokens_per_s": 1100.0, "elapsed_s": 8.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize(metrics, start_step=15)
    assert s["final_step"] == 25 and s["steps_trained"] == 10
    assert s["median_tokens_per_s"] == 1000.0 and s["wall_time_s"] == 8.0
    assert s["best_loss"] == 2.0 and s["final_loss"] == 2.0
    fresh = summarize(metrics)
    assert fresh["steps_trained"] == 25
    assert "10 (resumed at step 15)" in summary_table(metrics, start_step=15)

    stamped = tmp_path / "stamped.jsonl"  # no elapsed_s: the span of time stamps, extended to the start step
    stamped.write_text("".join(json.dumps({"step": s, "time": 100.0 + s, "loss": 1.0}) + "\n" for s in (20, 25, 30)))
    assert summarize(stamped, start_step=15)["wall_time_s"] == pytest.approx(15.0)


def test_keep_metrics_through_drops_later_and_broken_records(tmp_path):
    from plait.train.loggers import keep_metrics_through

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    assert keep_metrics_through(path, 2) == 2
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert keep_metrics_through(path, 2) == 0


# ---------------------------------------------------------------- a quiet clean stop (issue item 16)

def _record(logger: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(logger, logging.WARNING, __file__, 1, msg, args, None)


def test_clean_stop_filter_drops_only_the_narration_of_a_requested_stop():
    from plait.launch import CleanStopFilter

    agent, procs = CleanStopFilter.LOGGERS
    f = CleanStopFilter()
    closing = _record(procs, "Closing process %s via signal %s", 123, "SIGTERM")
    assert f.filter(closing), "closing workers after a real failure (no stop requested) still shows"
    assert f.filter(_record(agent, "Received %s death signal, shutting down workers", signal.SIGHUP))
    assert not f.filter(_record(agent, "Received %s death signal, shutting down workers", signal.SIGTERM))
    assert not f.filter(closing)
    assert not f.filter(_record(procs, "Closing process %s via signal %s", 124, "SIGINT"))
    assert f.filter(_record(procs, "Unable to shutdown process %s via %s, forcefully exiting via %s", 123,
                            signal.SIGTERM, signal.SIGKILL)), "a worker that does not stop still shows"
    assert f.filter(_record(agent, "worker 0 failed with exit code : %s", 1))


_LEAK_CHILD = """
import multiprocessing as mp, sys
from plait.launch import exit_worker_now

def child():
    from tqdm.auto import tqdm
    tqdm(total=1, disable=True).close()  # tqdm's write lock is a named semaphore
    exit_worker_now(0)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ctx.Event()  # the launcher's resource tracker, inherited by the worker, as under the elastic agent
    p = ctx.Process(target=child)
    p.start()
    p.join()
    sys.exit(p.exitcode)
"""


def test_a_worker_leaving_after_a_stop_signal_leaks_no_semaphore(tmp_path):
    script = tmp_path / "leak.py"
    script.write_text(_LEAK_CHILD)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "leaked semaphore" not in proc.stderr, proc.stderr


@pytest.mark.slow  # one `plait train` launch and stop: `make test-slow`
def test_sigterm_to_plait_train_is_quiet_and_logs_the_stopped_step(corpus, tmp_path):
    from plait.checkpoint.store import latest_checkpoint

    items = TINY + ["parallel.tp=1", "parallel.dp=2", "data.micro_batch_size=4", "train.log_every=1",
                    "train.eval_every=100000", "train.sample_tokens=0", "train.steps=100000",
                    f"data.source={corpus}", f"run.output_dir={tmp_path}"]
    metrics = tmp_path / "metrics.jsonl"
    returncode, out = train_then_sigterm([sys.executable, "-m", "plait.cli", "train", *items], metrics)
    assert returncode == 0, out
    for noise in ("death signal", "Closing process", "leaked semaphore", "Traceback"):
        assert noise not in out, out
    assert "plait: stopped by signal 15" in out
    step = int(latest_checkpoint(tmp_path / "checkpoints").name.split("-")[1])
    last = _records(metrics)[-1]
    assert last["step"] == step and last["stopped_by_signal"] == signal.SIGTERM, (last, step)


@pytest.mark.slow  # two `plait train` launches and stops: `make test-slow`
def test_a_stop_after_training_or_before_any_step_says_what_was_saved(corpus, tmp_path):
    """A SIGTERM during the end-of-run outputs (here a long sample) skips them and leaves at once, with
    the summary written and the run's checkpoint named; one before the first step says that nothing
    was saved (the launcher used to claim a checkpoint either way, and to wait 30 s for workers that
    ignored the signal while sampling)."""
    import time

    from plait.checkpoint.store import latest_checkpoint

    out_dir = tmp_path / "after"
    items = TINY + ["parallel.tp=1", "parallel.dp=2", "data.micro_batch_size=4", "train.log_every=1",
                    "train.eval_every=100000", "train.steps=3", "checkpoint.save_every=3",
                    "train.sample_tokens=100000", "model.max_position_embeddings=200000",
                    f"data.source={corpus}", f"run.output_dir={out_dir}"]
    start = time.monotonic()
    returncode, out = train_then_sigterm([sys.executable, "-m", "plait.cli", "train", *items],
                                         out_dir / "metrics.jsonl", records=3)
    assert returncode == 0, out
    assert time.monotonic() - start < 150 and "Unable to shutdown" not in out, out
    assert "stopped by signal 15 after training ended at step 3" in out, out
    assert f"the latest complete checkpoint is {latest_checkpoint(out_dir / 'checkpoints')}" in out, out
    assert (out_dir / "summary.txt").is_file() and not (out_dir / "sample.txt").exists()

    early = tmp_path / "early"
    proc = subprocess.Popen([sys.executable, "-m", "plait.cli", "train", *items[:-1], f"run.output_dir={early}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "launching 2 process(es)" in line:
            break
    time.sleep(1.0)  # the launcher is up, its workers are still importing: nothing can have been saved
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    assert "no checkpoint was saved" in out and "saved a checkpoint" not in out, out
