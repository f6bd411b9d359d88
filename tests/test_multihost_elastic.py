"""Elastic resize across two hosts (network namespaces, tests/netns.py): ``torchrun --nnodes 1:2``
on each host with ``checkpoint.resume=auto``. When one host is lost, the survivor restarts from
the newest checkpoint at half the world size: dp re-derived (2 -> 1), the checkpoint resharded,
the global batch kept (micro-batches 2 -> 4). The run's losses equal an unbroken 4-rank run's at
every step, before and after the loss of the host, whether the host crashed (its torchrun and
ranks killed at once) or only its torchrun was killed (its orphaned ranks leave by themselves).

A host that comes back joins at the next restart: torchrun stops the ranks (they write a checkpoint
on its SIGTERM) and the run grows back to dp=2 from that checkpoint; that needs
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` with torch 2.13 (see docs/launching.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns import ADDRESSES, IFACE, TwoHosts
from plait.checkpoint.store import complete_checkpoints
from plait.cluster.k8s import ELASTIC_ENVIRONMENT
from test_multihost import ENDPOINT, ITEMS, two_hosts  # noqa: F401 - the fixture
from trainer_runs import corpus_dir

STEPS = 30
#: what plait launch k8s sets for an elastic job: without it a host that joins later times out
GROWABLE = ELASTIC_ENVIRONMENT
ELASTIC = [f"train.steps={STEPS}", "parallel.tp=2", "parallel.microbatches=2", "data.global_batch_size=8",
           "checkpoint.save_every=5", "checkpoint.keep=10", "checkpoint.resume=auto", "train.stall_timeout_s=60"]


def _losses(out: Path) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def _lose_host(proc: subprocess.Popen, how: str) -> None:
    """``crash``: the host's torchrun and all its ranks die at once (a crashed host); ``agent``: only
    its torchrun dies (its ranks, orphaned, leave the run by themselves)."""
    for pid in [proc.pid, *(_descendants(proc.pid) if how == "crash" else [])]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _elastic_torchrun(hosts: TwoHosts, host: int, items: list[str], log: Path) -> subprocess.Popen:
    """One host's torchrun, its output to ``log`` (a file: a pipe left unread would block it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", ENDPOINT, "--rdzv-id", "elastic",
           # host 0 serves the rendezvous (and survives); a restart waits 5 s for more hosts before it starts
           "--rdzv-conf", f"is_host={str(host == 0).lower()},last_call_timeout=5,join_timeout=120",
           "--local-addr", ADDRESSES[host], "--monitor-interval", "0.5",
           "-m", "plait.cli", "train", *items, f"launch.iface={IFACE}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **GROWABLE}
    with log.open("w") as f:
        return hosts.popen(host, cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks of a host through /proc")
@pytest.mark.slow  # two 4-rank runs and a restart (~2-3 min on 2 shared cores): `make test-slow`
@pytest.mark.parametrize("how", ["crash", "agent"])
def test_losing_a_host_shrinks_dp_and_the_losses_continue(two_hosts, tmp_path_factory, how):  # noqa: F811
    corpus = corpus_dir(tmp_path_factory)
    base = tmp_path_factory.mktemp(f"elastic-{how}")
    items = ITEMS + ELASTIC + [f"data.source={corpus}", f"data.cache_dir={base / 'cache'}"]
    straight = subprocess.run([sys.executable, "-m", "plait.cli", "train", *items, "--nproc", "4",
                               f"run.output_dir={base / 'straight'}"], capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert straight.returncode == 0, straight.stdout + straight.stderr
    reference = _losses(base / "straight")

    out = base / "elastic"
    logs = [base / "host0.log", base / "host1.log"]
    procs = [_elastic_torchrun(two_hosts, host, items + [f"run.output_dir={out}"], logs[host]) for host in (0, 1)]

    def wait_for_checkpoint(step: int, what: str) -> None:
        deadline = time.monotonic() + 600
        while not any(s >= step for s, _ in complete_checkpoints(out / "checkpoints")):
            for p, log in zip(procs, logs, strict=False):
                assert p.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no checkpoint at step {step} appeared ({what})"
            time.sleep(0.05)

    wait_for_checkpoint(10, "two hosts")
    _lose_host(procs[1], how)
    procs[1].wait(timeout=30)
    procs.pop()
    procs[0].wait(timeout=900)  # host 0 restarts alone at world 2, resumes and finishes
    text = logs[0].read_text()
    assert procs[0].returncode == 0, text
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", text)]
    assert len(resumed) == 1 and resumed[0] >= 10, (resumed, text)
    assert "dp=1 at world size 2: parallel.microbatches 2 -> 4 keeps data.global_batch_size=8" in text, text
    got = _losses(out)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1)), (sorted(got), text)
    worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
    print(f"elastic ({how}): resumed at step {resumed[0]} on one host; worst relative loss difference {worst:.2e}")
    for step in reference:
        assert abs(got[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, got[step], reference[step])


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks of a host through /proc")
@pytest.mark.slow  # two 4-rank runs and two restarts (~4 min on 2 shared cores): `make test-slow`
def test_a_returning_host_grows_dp_again(two_hosts, tmp_path_factory):  # noqa: F811
    """Lost after step 10, host 1 comes back while host 0 trains on alone: host 0's torchrun restarts
    its ranks (they stop with a checkpoint on its SIGTERM), both hosts resume from that checkpoint at
    dp=2 again, and the losses of every step still equal the unbroken run's."""
    steps = 80  # long enough for host 1 to start again and join before host 0 ends alone
    corpus = corpus_dir(tmp_path_factory)
    base = tmp_path_factory.mktemp("grow")
    items = ITEMS + ELASTIC + [f"train.steps={steps}", f"data.source={corpus}", f"data.cache_dir={base / 'cache'}"]
    straight = subprocess.run([sys.executable, "-m", "plait.cli", "train", *items, "--nproc", "4",
                               f"run.output_dir={base / 'straight'}"], capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert straight.returncode == 0, straight.stdout + straight.stderr
    reference = _losses(base / "straight")

    out = base / "elastic"
    logs = [base / "host0.log", base / "host1.log", base / "host1-back.log"]
    procs = [_elastic_torchrun(two_hosts, host, items + [f"run.output_dir={out}"], logs[host]) for host in (0, 1)]
    deadline = time.monotonic() + 600
    while not any(s >= 10 for s, _ in complete_checkpoints(out / "checkpoints")):
        assert all(p.poll() is None for p in procs), "\n".join(log.read_text() for log in logs[:2])
        assert time.monotonic() < deadline, "no checkpoint at step 10 appeared"
        time.sleep(0.05)
    _lose_host(procs[1], "crash")
    procs[1].wait(timeout=30)
    while "resumed from" not in logs[0].read_text():  # host 0 restarted alone and resumed
        assert procs[0].poll() is None, logs[0].read_text()
        assert time.monotonic() < deadline, "host 0 did not resume alone"
        time.sleep(0.1)
    back = _elastic_torchrun(two_hosts, 1, items + [f"run.output_dir={out}"], logs[2])
    for p in (procs[0], back):
        p.wait(timeout=900)
    text = "\n".join(log.read_text() for log in logs)
    assert (procs[0].returncode, back.returncode) == (0, 0), text
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", text)]
    assert len(resumed) == 2 and 10 <= resumed[0] < resumed[1] < steps, (resumed, text)  # shrink, then grow
    assert "stopped by signal 15" in text, text  # the ranks of host 0 stopped with a checkpoint to take host 1 in
    got = _losses(out)
    assert sorted(got) == sorted(reference) == list(range(1, steps + 1)), (sorted(got), text)
    worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
    print(f"elastic: shrank at step {resumed[0]}, grew at step {resumed[1]}; worst relative loss difference "
          f"{worst:.2e}")
    for step in reference:
        assert abs(got[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, got[step], reference[step])
