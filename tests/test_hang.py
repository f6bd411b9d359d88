"""Hang diagnosis: when a collective stalls, every rank dumps the Python stacks of its threads and
the last collective it entered per group to ``hang/rank-N.txt``, and rank 0 names the ranks that
never arrived. Two gloo ranks; rank 1 sleeps inside step 3, outside any collective."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed

TIMEOUT = 1.0
GROUP = "group dp, ranks [0, 1]"


def _sleepy_step_of_rank_1() -> None:
    time.sleep(3 * TIMEOUT + 1.0)  # what a stuck data loader or a slow disk looks like from outside


def _worker(rank, world, out_dir):
    import contextlib
    import io

    from plait.comm.primitives import all_reduce
    from plait.train.watchdog import Watchdog

    messages: list[str] = []
    err = io.StringIO()
    dog = Watchdog(TIMEOUT, rank, on_stall=messages.append, poll=0.1, dump_dir=out_dir)
    with contextlib.redirect_stderr(err):
        for step in range(4):
            with dog.watch("tensor-parallel all-reduce", "group tp, ranks [0]"):
                pass  # a 1-rank group: entered, recorded, nothing to wait for
            if rank == 1 and step == 2:
                _sleepy_step_of_rank_1()
            with dog.watch("data-parallel gradient reduction", GROUP):
                all_reduce(torch.ones(1), dist.group.WORLD)
            dog.step += 1
        dog.close()
    return {"messages": messages, "stderr": err.getvalue()}


@pytest.mark.slow  # waits out a stall (several seconds by design): `make test-slow`
def test_a_stall_dumps_every_rank_and_names_the_rank_that_never_arrived(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path))
    r0, r1 = results
    assert len(r0["messages"]) == 1 and "rank 0 stalled for" in r0["messages"][0], r0
    assert f"data-parallel gradient reduction ({GROUP}) at step 3" in r0["messages"][0]
    assert r1["messages"] == [], r1  # rank 1 was not in a collective: it reports, and the launcher stops it
    summary = r0["stderr"]
    assert ("plait watchdog: step 3, data-parallel gradient reduction: ranks that never arrived: rank 1 on "
            in summary), summary
    assert "(at step 3, outside any collective); arrived: 0" in summary, summary
    assert f"{tmp_path}/hang/rank-N.txt" in summary
    assert "rank 1 stops: a peer stalled" in r1["stderr"], r1
    dump0 = (tmp_path / "hang" / "rank-0.txt").read_text()
    dump1 = (tmp_path / "hang" / "rank-1.txt").read_text()
    assert "phase: data-parallel gradient reduction (group dp, ranks [0, 1])" in dump0, dump0
    assert f"  {GROUP}: data-parallel gradient reduction at step 3" in dump0
    assert "  group tp, ranks [0]: tensor-parallel all-reduce at step 3" in dump0
    assert "phase: none (outside any collective)" in dump1, dump1
    assert f"  {GROUP}: data-parallel gradient reduction at step 2" in dump1  # its last one was a step behind
    # the stacks: rank 1's main thread is in the sleep; rank 0's in the all-reduce; both show the watchdog thread
    assert "_sleepy_step_of_rank_1" in dump1 and "Thread MainThread" in dump1, dump1
    assert "all_reduce(torch.ones(1), dist.group.WORLD)" in dump0 and "Thread plait-watchdog" in dump0, dump0
    # the comm layer's count: rank 0 entered its 3rd all-reduce on the group, rank 1 only 2
    assert "  ranks [0, 1]: 3 entered, the last one all_reduce" in dump0, dump0
    assert "  ranks [0, 1]: 2 entered, the last one all_reduce" in dump1, dump1


def test_the_summary_names_ranks_outside_the_collective_and_those_without_a_report():
    from plait.train.watchdog import Watchdog

    dog = Watchdog(0, 0, world=4)  # timeout 0: no thread; only the summary is used
    op = "gradient-norm all-reduce"
    mine = {"rank": 0, "step": 7, "operation": op, "group": "group tp, ranks [0, 1]; group dp, ranks [0, 2]",
            "stalled": True, "host": "a"}
    reports = {0: mine, 1: {**mine, "rank": 1},
               2: {"rank": 2, "step": 7, "operation": "forward/backward", "group": "", "stalled": True, "host": "b"}}
    text = dog.summary(mine, reports)
    assert text == ("plait watchdog: step 7, gradient-norm all-reduce: ranks that never arrived: rank 2 on b (at "
                    "step 7, in forward/backward); arrived: 0, 1"), text
    everyone = {**mine, "group": "all ranks"}
    text = dog.summary(everyone, {0: everyone, 1: {**everyone, "rank": 1}, 2: {**everyone, "rank": 2}})
    assert "ranks that never arrived: rank 3 (no report: its process is gone or frozen); arrived: 0, 1, 2" in text


def _proc_children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _local_rank(pid: int) -> str | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"LOCAL_RANK=")]
    return found[0] if found else None


@pytest.mark.slow  # a torchrun job that trains, then stalls on purpose (~30-60 s): `make test-slow`
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
def test_plait_train_names_a_frozen_rank_and_writes_the_dumps(tmp_path_factory):
    """The real path: `plait train` under torchrun; rank 1 is frozen (SIGSTOP) mid-run, so it can
    neither compute nor report; rank 0 stalls in a collective, dumps, names rank 1 as the rank that
    never arrived (no report: frozen), and the job ends with the watchdog's status."""
    from trainer_runs import corpus_dir

    corpus = corpus_dir(tmp_path_factory)
    out = tmp_path_factory.mktemp("frozen")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    items = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
             "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
             "data.micro_batch_size=2", "scheduler.warmup_steps=2", "train.steps=100000", "train.log_every=1",
             "train.eval_every=100000", "train.sample_tokens=0", "checkpoint.save_final=false",
             "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false",
             "train.stall_timeout_s=3", f"data.source={corpus}", f"run.output_dir={out}"]
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "plait.cli", "train", *items]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    frozen = None
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 3):
            assert job.poll() is None, job.communicate()[0]
            assert time.monotonic() < deadline, "no training steps"
            time.sleep(0.05)
        frozen = next(pid for pid in _proc_children(job.pid) if _local_rank(pid) == "1")
        os.kill(frozen, signal.SIGSTOP)
        log, _ = job.communicate(timeout=300)
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGKILL)
        if job.poll() is None:
            job.kill()
    print("\n".join(line for line in log.splitlines() if line.startswith("plait watchdog")))
    assert "plait watchdog: rank 0 stalled for" in log, log
    assert "ranks that never arrived: rank 1 (no report: its process is gone or frozen); arrived: 0" in log, log
    dump = (out / "hang" / "rank-0.txt").read_text()
    assert "Thread MainThread" in dump and "last collective entered per group:" in dump, dump
    assert not (out / "hang" / "rank-1.txt").exists()  # a frozen rank writes nothing: hence "no report"
