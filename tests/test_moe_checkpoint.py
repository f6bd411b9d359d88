"""MoE checkpoints across expert-parallel degrees, and the final Hugging Face export under EP.

Every expert is a whole tensor under its global name, written once by one of the ranks holding it
(its expert-data-parallel replicas), so a checkpoint of any EP degree loads under any other. The
chain EP=2 -> EP=1 -> EP=4 must continue with the losses of the run that never changed layout
(relative 1e-5); the first and last legs use ZeRO-1, so the experts' optimizer state is written
from, and read into, shards. Slow: several multi-process runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from trainer_runs import corpus_dir, run_checkpointed

BASE = ["model.family=mixtral", "model.hidden_size=64", "model.intermediate_size=32", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "model.num_local_experts=4",
        "model.num_experts_per_tok=2", "model.tie_word_embeddings=false", "moe.aux_loss_coef=0.1",
        "moe.z_loss_coef=0.01", "data.vocab_size=320", "data.seq_len=32", "data.micro_batch_size=2",
        "parallel.sequence_parallel=false", "optimizer.grad_clip=1.0", "scheduler.warmup_steps=2",
        "optimizer.lr=1.5e-3", "parallel.tp=1", "logging.progress_bar=false", "logging.tensorboard=false",
        "checkpoint.async_save=false", "train.sample_tokens=0"]
N, MID, END = 3, 6, 12
#: every layout trains on 8 sequences per step in the same micro-batches of 2
EP2 = ["parallel.dp=2", "parallel.ep=2", "parallel.microbatches=2"]
#: ZeRO-1 shards the experts' optimizer state over their expert-data-parallel group (2 ranks here)
EP2_DP4_ZERO = ["parallel.dp=4", "parallel.ep=2", "parallel.zero1=true", "parallel.microbatches=1"]
EP1 = ["parallel.microbatches=4"]
EP4 = ["parallel.dp=4", "parallel.ep=4", "parallel.zero1=true", "parallel.microbatches=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


@pytest.mark.slow
def test_ep2_to_ep1_to_ep4_continues_the_unbroken_run(corpus, tmp_path):
    steps = [f"train.steps={END}"]
    ref = run_checkpointed(corpus, tmp_path / "a", BASE + EP2_DP4_ZERO + steps, 4, END, save_at=N)
    expected = ref[0]["losses"]
    b = run_checkpointed(corpus, tmp_path / "b", BASE + EP1 + steps + [
        f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / f'step-{N:08d}'}"], 1, MID - N, save_at=MID)
    c = run_checkpointed(corpus, tmp_path / "c", BASE + EP4 + steps + [
        f"checkpoint.resume={tmp_path / 'b' / 'checkpoints' / f'step-{MID:08d}'}"], 4, END - MID)
    assert b[0]["start"] == N and all(r["start"] == MID for r in c)
    for got, want in ((b[0]["losses"], expected[N:MID]), *((r["losses"], expected[MID:]) for r in c)):
        rel = max(abs(x - y) / y for x, y in zip(got, want, strict=True))
        assert rel <= 1e-5, f"relative loss difference {rel:.2e}\n{got}\n{want}"


@pytest.mark.slow
def test_final_hf_export_under_ep2_holds_every_expert(corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "plait.cli", "train", *BASE, *EP2, f"data.source={corpus}", f"run.output_dir={out}",
           "train.steps=2", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
           "train.sample_tokens=3", "--nproc", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensors = load_file(out / "final" / "model.safetensors")
    for layer in range(2):
        for e in range(4):
            for w in ("w1", "w2", "w3"):
                assert f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" in tensors
    assert json.loads((out / "final" / "config.json").read_text())["num_local_experts"] == 4
    model = transformers.MixtralForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[3],
                       tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"])
    assert (out / "sample.txt").read_text().strip()
