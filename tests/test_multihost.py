"""Two hosts on one machine (network namespaces joined by a veth pair, tests/netns.py): one
``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` per host running ``plait train``
gives, over 20 steps, the losses of the same recipe on one host with 4 ranks: TP=2 inside a host
x DP=2 across the hosts, PP=2 across the hosts (x DP=2 inside), and DP=4 with ZeRO-3 sharded
inside each host and replicated across them (``parallel.shard_over: host``). A host that never joins ends
the other's ``plait train --nnodes 2`` within ``launch.rdzv_timeout_s`` with an error naming the
endpoint and the hosts missing. Skipped (with the reason printed) only where namespaces cannot be
created.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns import ADDRESSES, IFACE, TwoHosts, namespaces_unavailable
from trainer_runs import corpus_dir

STEPS = 20
PORT = 29400
ENDPOINT = f"{ADDRESSES[0]}:{PORT}"
ITEMS = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
         "data.micro_batch_size=2", "scheduler.warmup_steps=2", f"train.steps={STEPS}", "train.log_every=1",
         "train.eval_every=1000", "train.sample_tokens=0", "checkpoint.save_final=false",
         "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false"]
LAYOUTS = {"tp2-dp2": ["parallel.tp=2"], "pp2-dp2": ["parallel.pp=2", "parallel.microbatches=2"],
           # hybrid sharding: ZeRO-3 over each host's 2 ranks, replicated across the hosts (on one host:
           # sharded over all 4)
           "dp4-zero3-hybrid": ["parallel.zero=3", "parallel.shard_over=host"]}
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def two_hosts(request) -> TwoHosts:
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"two-host tests skipped: {reason}")
        pytest.skip(reason)
    hosts = TwoHosts()
    request.addfinalizer(hosts.close)  # processes ended and namespaces deleted whatever happens

    def interrupted(signum, frame):  # noqa: ARG001 - SIGTERM (a timeout killing pytest): run the finalizer too
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))
    return hosts


def _env() -> dict[str, str]:
    import os

    return {**os.environ, **ENV}


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(by_step) == list(range(1, STEPS + 1)), sorted(by_step)
    return [by_step[s] for s in range(1, STEPS + 1)]


def _one_host(out: Path, items: list[str]) -> list[float]:
    cmd = [sys.executable, "-m", "plait.cli", "train", *items, "--nproc", "4", f"run.output_dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return _losses(out)


def _torchrun(hosts: TwoHosts, host: int, out: Path, items: list[str], rdzv_id: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", ENDPOINT, "--rdzv-id", rdzv_id,
           # the endpoint is an address, not this machine's host name: say which host serves the store
           "--rdzv-conf", f"is_host={str(host == 0).lower()}",
           # both namespaces share one host name; advertise the veth address to the other host's ranks
           "--local-addr", ADDRESSES[host],
           "-m", "plait.cli", "train", *items, f"launch.iface={IFACE}", f"run.output_dir={out}"]
    return hosts.popen(host, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())


@pytest.mark.slow  # two 4-rank runs per layout (~1 min each on 2 cores): `make test-slow`
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_hosts_match_one_host(two_hosts, tmp_path_factory, layout):
    corpus = corpus_dir(tmp_path_factory)
    base = tmp_path_factory.mktemp(layout)
    items = ITEMS + LAYOUTS[layout] + [f"data.source={corpus}", f"data.cache_dir={base / 'cache'}"]
    reference = _one_host(base / "one-host", items)
    procs = [_torchrun(two_hosts, host, base / "two-hosts", items, f"parity-{layout}") for host in (0, 1)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for host, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"host {host}:\n{log}"
    got = _losses(base / "two-hosts")
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference, got, strict=True))
    print(f"{layout}: two hosts vs one host over {STEPS} steps: worst relative loss difference {worst:.2e}"
          f"{' (bitwise equal)' if reference == got else ''}")
    for step, (a, b) in enumerate(zip(reference, got, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: one host {a!r}, two hosts {b!r}"


@pytest.mark.slow  # waits out a 15 s rendezvous timeout
def test_a_host_that_never_joins_is_named_within_the_timeout(two_hosts, tmp_path_factory):
    corpus = corpus_dir(tmp_path_factory)
    base = tmp_path_factory.mktemp("lonely")
    timeout = 15
    cmd = [sys.executable, "-m", "plait.cli", "train", *ITEMS, f"data.source={corpus}", f"run.output_dir={base}",
           "--nnodes", "2", "--nproc", "2", "--rdzv-endpoint", ENDPOINT, "--rdzv-id", "lonely",
           "--iface", IFACE, "--rdzv-timeout", str(timeout)]
    start = time.monotonic()
    proc = two_hosts.popen(0, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    out, err = proc.communicate(timeout=timeout + 60)  # the other host never starts
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, out + err
    print(err)
    assert f"the rendezvous at {ENDPOINT} (run id 'lonely') did not complete within {timeout} s" in err, err
    assert "1 of 2 hosts never joined" in err, err
    assert elapsed < timeout + 30, elapsed


@pytest.mark.slow  # a 4-rank run on one host and one across two (~1 min each on 2 cores): `make test-slow`
def test_plait_train_nnodes_matches_one_host(two_hosts, tmp_path_factory):
    """The same through `plait train --nnodes 2 --rdzv-endpoint ... --iface ...` on each host (no torchrun):
    the store host is found by address and the advertised address comes from the interface."""
    corpus = corpus_dir(tmp_path_factory)
    base = tmp_path_factory.mktemp("nnodes")
    items = ITEMS + LAYOUTS["tp2-dp2"] + [f"data.source={corpus}", f"data.cache_dir={base / 'cache'}"]
    reference = _one_host(base / "one-host", items)
    cmd = [sys.executable, "-m", "plait.cli", "train", *items, f"run.output_dir={base / 'two-hosts'}",
           "--nnodes", "2", "--nproc", "2", "--rdzv-endpoint", ENDPOINT, "--rdzv-id", "nnodes", "--iface", IFACE]
    procs = [two_hosts.popen(host, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
             for host in (0, 1)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for host, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"host {host}:\n{log}"
    assert reference == _losses(base / "two-hosts")
