"""The generated sbatch script, run for real on two "nodes" (the network namespaces of
tests/netns.py) with stub ``srun`` and ``scontrol``: the stub ``srun`` starts the script's per-node
command in each namespace with ``SLURM_NODEID`` set (as SLURM does, one task per node) and passes
SIGTERM on to them. The job trains; USR1 (what ``--signal=B:USR1@300`` sends before the time
limit) makes it requeue itself and stop with a checkpoint; the requeued job (the same script run
again, as SLURM would) resumes from that checkpoint and finishes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from netns import ADDRESSES, IFACE, TwoHosts
from plait.checkpoint.store import complete_checkpoints
from plait.cli import main
from test_multihost import ITEMS, two_hosts  # noqa: F401 - the fixture
from trainer_runs import corpus_dir

STEPS = 40
SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' {hosts}; exit 0; fi
echo "stub scontrol: $*" >> "$STUB_LOG"
"""
SRUN = """#!/bin/bash
# srun's own options are --name=value words before the command
while [[ "$1" == --* ]]; do shift; done
pids=()
i=0
for ns in $STUB_NAMESPACES; do
    ip netns exec "$ns" env SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" &
    pids+=($!)
    i=$((i + 1))
done
trap 'kill -TERM "${{pids[@]}}" 2>/dev/null' TERM
status=0
for p in "${{pids[@]}}"; do
    while true; do wait "$p" && break || s=$?; kill -0 "$p" 2>/dev/null || {{ status=$s; break; }}; done
done
exit $status
"""


def _recipe(path: Path, corpus: Path, out: Path) -> None:
    from plait.config import recipe_data
    from plait.config.load import DEFAULT_RECIPE

    items = ITEMS + ["parallel.tp=2", f"train.steps={STEPS}", "checkpoint.save_every=5", f"data.source={corpus}",
                     f"data.cache_dir={out.parent / 'cache'}", f"run.output_dir={out}"]
    path.write_text(yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items), sort_keys=False))


def _job(hosts: TwoHosts, script: Path, stubs: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node[1-2]", "PLAIT_PYTHON": sys.executable, "STUB_LOG": str(log),
           "STUB_NAMESPACES": " ".join(hosts.names), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    hosts.processes.append(proc)  # ended (its whole session) by the fixture's finalizer whatever happens
    return proc


@pytest.mark.slow  # two short jobs of 4 ranks on 2 "nodes" (~2-3 min on 2 shared cores): `make test-slow`
def test_the_sbatch_script_trains_requeues_on_usr1_and_resumes(two_hosts, tmp_path_factory):  # noqa: F811
    corpus = corpus_dir(tmp_path_factory)
    base = tmp_path_factory.mktemp("slurm")
    recipe, out, script = base / "recipe.yaml", base / "run", base / "job.sbatch"
    _recipe(recipe, corpus, out)
    assert main(["launch", "slurm", str(recipe), "--nodes", "2", "--gpus-per-node", "2", "--iface", IFACE,
                 "-o", str(script)]) == 0
    stubs = base / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text(SCONTROL.format(hosts=" ".join(ADDRESSES)))
    (stubs / "srun").write_text(SRUN.format())
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    log = base / "scontrol.log"

    first = _job(two_hosts, script, stubs, log)
    deadline = time.monotonic() + 600
    while not any(step >= 5 for step, _ in complete_checkpoints(out / "checkpoints")):
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGUSR1)  # the batch shell only, as --signal=B:USR1@300 does
    text, _ = first.communicate(timeout=600)  # torchrun itself exits non-zero after a SIGTERM; SLURM requeues anyway
    assert "stub scontrol: requeue 4242" in log.read_text(), text
    found = re.findall(r"stopped by signal 15 after step (\d+); checkpoint written", text)
    assert len(found) == 1, f"the ranks did not stop with a checkpoint on SIGTERM:\n{text}"
    stopped = int(found[0])
    assert stopped < STEPS and max(step for step, _ in complete_checkpoints(out / "checkpoints")) == stopped

    second = _job(two_hosts, script, stubs, log)  # the requeued job: the same script, the same job id
    text, _ = second.communicate(timeout=900)
    assert second.returncode == 0, text
    resumed = re.findall(r"resumed from \S+ at step (\d+)", text)
    assert resumed == [str(stopped)], text
    assert max(step for step, _ in complete_checkpoints(out / "checkpoints")) == STEPS
