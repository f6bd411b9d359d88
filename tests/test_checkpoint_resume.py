"""Checkpoint resume and resharding through the real trainer (fp32, Shakespeare).

*Exact resume*: a run of 2N steps equals N steps, a checkpoint, a new set of processes that
resumes from it, and N more steps: losses and final weights bit for bit (same layout).

*Resharding*: a checkpoint written under one layout, loaded under another, continues with the
losses of the run that never changed layout (relative 1e-5: the layouts add partial sums in
different orders, as in tests/test_dp_parity.py).
"""

from __future__ import annotations

import pytest
import torch

from trainer_runs import corpus_dir, merged_weights, run_checkpointed

BASE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=4", "data.vocab_size=320", "data.seq_len=32",
        "parallel.sequence_parallel=false", "optimizer.grad_clip=1.0", "scheduler.warmup_steps=2",
        "optimizer.lr=1.5e-3", "logging.progress_bar=false", "logging.tensorboard=false",
        "model.tie_word_embeddings=false", "parallel.bucket_mb=0.05", "checkpoint.async_save=false", "parallel.tp=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


def _run(corpus, out, items, world, steps, save_at=-1):
    return run_checkpointed(corpus, out, BASE + items, world, steps, save_at)


N = 3
EXACT = {
    "tp2-dropout": (["parallel.tp=2", "data.micro_batch_size=4", "model.attention_dropout=0.1",
                     "model.hidden_dropout=0.1"], 2),
    "pp2": (["parallel.pp=2", "parallel.microbatches=4", "data.micro_batch_size=2"], 2),
    "dp2-zero1": (["parallel.dp=2", "parallel.zero1=true", "data.micro_batch_size=4"], 2),
    "dp2-zero3": (["parallel.dp=2", "parallel.zero=3", "data.micro_batch_size=4"], 2),
    "dp2-zero2-offload-bf16-mixed": (["parallel.dp=2", "parallel.zero=2", "parallel.offload_optimizer=true",
                                      "precision.preset=bf16-mixed", "data.micro_batch_size=4"], 2),
    "pp2xtp2xdp2-zero1": (["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "parallel.zero1=true",
                           "parallel.microbatches=2", "data.micro_batch_size=2"], 8),
}


#: the 8-rank cases take about a minute each on 2 cores: they run with `make test-slow`
SLOW = {"pp2xtp2xdp2-zero1", "tp2xpp2xdp2-to-tp4xdp2", "tp2xdp2-zero1-to-dp2-zero3", "dp2-zero2-to-dp1",
        "dp2-zero2-offload-bf16-mixed"}


def _params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


@pytest.mark.parametrize("name", _params(EXACT))
def test_resume_is_bitwise_exact(corpus, tmp_path, name):
    items, world = EXACT[name]
    steps = [f"train.steps={2 * N}"]
    straight = _run(corpus, tmp_path / "straight", items + steps, world, 2 * N)
    first = _run(corpus, tmp_path / "split", items + steps, world, N, save_at=N)
    assert (tmp_path / "split" / "checkpoints" / f"step-{N:08d}" / "manifest.json").is_file()
    second = _run(corpus, tmp_path / "split", items + steps + ["checkpoint.resume=auto"], world, N)
    assert all(r["start"] == N for r in second)
    for a, b, c in zip(straight, first, second, strict=True):
        assert b["losses"] + c["losses"] == a["losses"], (b["losses"], c["losses"], a["losses"])
    ref, got = merged_weights(straight), merged_weights(second)
    assert set(ref) == set(got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


AFTER = 10
#: name: (layout A, world A, layout B, world B); every layout trains on 8 sequences per step
RESHARD = {
    "tp2-to-tp1": (["parallel.tp=2", "data.micro_batch_size=8"], 2, ["data.micro_batch_size=8"], 1),
    "tp1-to-tp4-kvrep": (["data.micro_batch_size=8"], 1, ["parallel.tp=4", "data.micro_batch_size=8"], 4),
    "pp2-to-pp1": (["parallel.pp=2", "parallel.microbatches=4", "data.micro_batch_size=2"], 2,
                   ["parallel.microbatches=4", "data.micro_batch_size=2"], 1),
    "pp1-to-pp2-vpp2": (["parallel.microbatches=4", "data.micro_batch_size=2"], 1,
                        ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved-1f1b",
                         "parallel.microbatches=4", "data.micro_batch_size=2"], 2),
    "dp2-zero1-to-dp1": (["parallel.dp=2", "parallel.zero1=true", "data.micro_batch_size=4"], 2,
                         ["data.micro_batch_size=8"], 1),
    # across ZeRO levels: the checkpoint holds whole tensors whatever the level wrote it
    "dp2-zero3-to-dp2-zero1": (["parallel.dp=2", "parallel.zero=3", "data.micro_batch_size=4"], 2,
                               ["parallel.dp=2", "parallel.zero=1", "data.micro_batch_size=4"], 2),
    "tp2xdp2-zero1-to-dp2-zero3": (["parallel.tp=2", "parallel.dp=2", "parallel.zero=1", "data.micro_batch_size=4"],
                                   4, ["parallel.dp=2", "parallel.zero=3", "parallel.microbatches=2",
                                       "data.micro_batch_size=2"], 2),
    "dp2-zero2-to-dp1": (["parallel.dp=2", "parallel.zero=2", "data.micro_batch_size=4"], 2,
                         ["data.micro_batch_size=8"], 1),
    "tp2xpp2xdp2-to-tp4xdp2": (["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.zero1=true",
                                "parallel.microbatches=2", "data.micro_batch_size=2"], 8,
                               ["parallel.tp=4", "parallel.dp=2", "data.micro_batch_size=4"], 8),
}


@pytest.mark.parametrize("name", _params(RESHARD))
def test_checkpoint_loads_under_another_layout(corpus, tmp_path, name):
    a, world_a, b, world_b = RESHARD[name]
    steps = [f"train.steps={N + AFTER}"]
    ref = _run(corpus, tmp_path / "a", a + steps, world_a, N + AFTER, save_at=N)
    ckpt = tmp_path / "a" / "checkpoints" / f"step-{N:08d}"
    resumed = _run(corpus, tmp_path / "b", b + steps + [f"checkpoint.resume={ckpt}"], world_b, AFTER)
    expected = ref[-1]["losses"][N:]  # the last rank holds the pipeline's loss on every layout
    for rank, r in enumerate(resumed):
        assert r["start"] == N
        rel = max(abs(x - y) / y for x, y in zip(r["losses"], expected, strict=True))
        assert rel <= 1e-5, f"rank {rank}: relative loss difference {rel:.2e}\n{r['losses']}\n{expected}"
