"""A rank killed with SIGKILL under ``torchrun --max-restarts=1``: the job comes back from the last
checkpoint by itself (``checkpoint.resume=auto``) and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.store import complete_checkpoints, latest_checkpoint
from trainer_runs import corpus_dir

STEPS = 60
ITEMS = ["model.hidden_size=128", "model.intermediate_size=256", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=64",
         "parallel.tp=1", "parallel.sequence_parallel=false", "data.micro_batch_size=8", "scheduler.warmup_steps=2",
         f"train.steps={STEPS}", "train.log_every=5", "train.eval_every=1000", "train.sample_tokens=0",
         "checkpoint.save_final=false", "checkpoint.save_every=10", "checkpoint.resume=auto",
         "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false"]


def _torchrun(out: Path, corpus: Path, restarts: int) -> subprocess.Popen:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", f"--max-restarts={restarts}", "-m", "plait.cli",
           "train", *ITEMS, f"data.source={corpus}", f"run.output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _model_and_state(directory: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(directory) as reader:
        out = {}
        for key, info in reader.tensors.items():
            kind, name = key.split("/", 1)
            t = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
            reader.read_into(kind, name, t)
            out[key] = t
        return out


@pytest.mark.slow  # two torchrun jobs, ~18 s: `make test-slow`
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker processes through /proc")
def test_killed_rank_restarts_from_the_last_checkpoint(tmp_path_factory):
    corpus = corpus_dir(tmp_path_factory)
    base = tmp_path_factory.mktemp("torchrun")
    straight = _torchrun(base / "straight", corpus, 0)
    log, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, log

    faulty = _torchrun(base / "faulty", corpus, 1)
    deadline = time.monotonic() + 300
    root = base / "faulty" / "checkpoints"
    while not any(step >= 10 for step, _ in complete_checkpoints(root)):
        assert faulty.poll() is None, faulty.communicate()[0]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    workers = _children(faulty.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    log, _ = faulty.communicate(timeout=600)
    assert faulty.returncode == 0, log
    assert "resumed from" in log, log
    a, b = latest_checkpoint(base / "straight" / "checkpoints"), latest_checkpoint(root)
    assert a.name == b.name == f"step-{STEPS:08d}"
    ref, got = _model_and_state(a), _model_and_state(b)
    assert set(ref) == set(got)
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
