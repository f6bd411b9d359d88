"""The host-sync detector: reads inside watched steps are reported with their stacks (CPU path).

The CUDA path (``torch.cuda.set_sync_debug_mode``) needs a GPU and is not exercised here.
"""

from __future__ import annotations

import threading

import pytest
import torch

from plait.train.host_syncs import HOST_READ_METHODS, HostSyncDetector
from test_zero_bubble import _runtime_and_optimizer


def _step_that_reads(x: torch.Tensor) -> float:
    loss = (x * 2).sum()
    value = loss.item()  # the read the detector must find, with this function in its stack
    if torch.isnan(loss):  # bool() of a tensor: a second read
        value = 0.0
    return value


def test_reads_are_reported_with_their_stack_and_only_in_watched_steps():
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READ_METHODS}
    detector = HostSyncDetector(torch.device("cpu"), steps=2)
    x = torch.ones(3)
    with detector.step(0):
        (x * 3).sum()  # device work only: nothing to report
    assert detector.reads == []
    with detector.step(1):
        _step_that_reads(x)
    with detector.step(2):  # past `steps`: not watched
        _step_that_reads(x)
    assert detector.done
    assert [r.what.split("(")[0] for r in detector.reads] == ["Tensor.item", "Tensor.__bool__"]
    assert all(r.step == 1 for r in detector.reads)
    first = detector.reads[0]
    assert "_step_that_reads" in first.stack[-1] and "value = loss.item()" in first.stack[-1]
    assert "test_reads_are_reported" in "".join(first.stack)
    report = detector.report()
    assert report.startswith("detect_host_syncs: 2 device-to-host read(s) in the first 2 step(s)")
    assert "value = loss.item()" in report
    assert {name: getattr(torch.Tensor, name) for name in HOST_READ_METHODS} == originals, "methods restored"


def test_reads_from_other_threads_are_not_counted_and_clean_steps_say_so():
    detector = HostSyncDetector(torch.device("cpu"), steps=1)
    with detector.step(0):
        t = threading.Thread(target=lambda: torch.ones(2).sum().item())
        t.start()
        t.join()
    assert detector.reads == []
    assert detector.report() == ("detect_host_syncs: no device-to-host read in the first 1 step(s) "
                                 "(counting Tensor host reads)")


def test_a_zero_bubble_pipeline_step_reads_nothing():
    # the runtime with zb-h1's B/W split and the gradient reduction never wait for the device
    # (1F1B through the trainer: tests/test_trainer.py)
    runtime, opt, _ = _runtime_and_optimizer("zb-h1", "params")
    batch = torch.randint(0, 64, (3, 2, 8), generator=torch.Generator().manual_seed(0))
    detector = HostSyncDetector(torch.device("cpu"), steps=1)
    with detector.step(0):
        runtime.run(batch)
        opt.grads.finish()
    assert detector.reads == [], detector.report()


def _fit_worker(rank, world, recipe_yaml, prepared, add_read):
    import contextlib
    import io

    import yaml

    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    if add_read:  # a user change that reads the loss on the host inside the step
        run = trainer.state.runtime.run

        def run_and_read(batch, **kw):
            loss = run(batch, **kw)
            loss.item()
            return loss
        trainer.state.runtime.run = run_and_read
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit()
    return out.getvalue()


@pytest.mark.slow  # two spawned runs
def test_train_detect_host_syncs_reports_the_first_steps_of_a_run(tmp_path_factory):
    """``train.detect_host_syncs: true`` watches the first 3 steps of a run: plait's own step reads
    nothing on the host; a read added inside the step is reported with its stack."""
    import yaml

    from distributed import run_distributed
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data
    from trainer_runs import corpus_dir

    corpus = corpus_dir(tmp_path_factory)
    outputs = []
    for add_read in (False, True):
        items = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=4",
                 "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=300", "data.seq_len=32",
                 "data.micro_batch_size=2", "parallel.tp=1", "parallel.sequence_parallel=false", "train.steps=4",
                 "scheduler.warmup_steps=1",
                 "train.log_every=2", "train.eval_every=100", "train.eval_batches=1", "train.sample_tokens=0",
                 "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false",
                 "checkpoint.save_final=false", "train.detect_host_syncs=true", f"data.source={corpus}",
                 f"run.output_dir={tmp_path_factory.mktemp('run')}"]
        prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
        outputs += run_distributed(_fit_worker, 1, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared,
                                   add_read)
    clean, reading = outputs
    assert "detect_host_syncs: no device-to-host read in the first 3 step(s)" in clean, clean
    assert "detect_host_syncs: 3 device-to-host read(s) in the first 3 step(s)" in reading, reading
    assert "loss.item()" in reading and "run_and_read" in reading, reading
