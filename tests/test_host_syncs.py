"""The host-sync detector: reads inside watched steps are reported with their stacks (CPU path).

The CUDA path (``torch.cuda.set_sync_debug_mode``) needs a GPU and is not exercised here.
"""

from __future__ import annotations

import threading

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
