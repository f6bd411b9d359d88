"""The global gradient norm under TP (sharded, replicated and KV-replicated parameters) equals
the single-process norm; clipping scales like torch's clip_grad_norm_; LR schedule shape."""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run_distributed


def _config():
    from plait.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                       max_position_embeddings=16, tie_word_embeddings=True)


def _norm(mesh, sp):
    from builders import build_llama
    from grad_norm_reference import global_grad_norm

    model = build_llama(_config(), mesh, seed=5, sequence_parallel=sp)
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, ids).backward()
    return global_grad_norm(model, mesh.info("tp")).item()


def _worker(rank, world, sp):
    from plait.mesh import ParallelMesh
    from plait.models.llama.parallelize import kv_replication_for

    mesh = ParallelMesh(world, rank, tp=world, kv_replication=kv_replication_for(_config(), world))
    return _norm(mesh, sp)


@pytest.mark.parametrize("tp,sp", [(2, True), (4, False)], ids=["tp2-sp-kvrep2", "tp4-kvrep4"])
def test_grad_norm_matches_single_process(tp, sp):
    from plait.mesh import single_process_mesh

    ref = _norm(single_process_mesh(), False)
    for rank, norm in enumerate(run_distributed(_worker, tp, sp)):
        assert abs(norm - ref) <= 1e-5 * ref, f"rank {rank}: {norm} vs single-process {ref}"


def test_clip_matches_torch():
    from builders import build_llama
    from grad_norm_reference import clip_by_norm_, global_grad_norm
    from plait.mesh import single_process_mesh

    a = build_llama(_config(), single_process_mesh(), seed=5)
    b = build_llama(_config(), single_process_mesh(), seed=5)
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (a, b):
        m(ids, ids).backward()
    norm = global_grad_norm(a, single_process_mesh().info("tp"))
    clip_by_norm_(a, norm, 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    assert torch.allclose(norm, ref_norm, rtol=1e-6)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-8), n


def test_lr_schedule_shapes():
    from plait.train.lr_schedules import lr_factor

    kw = dict(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert lr_factor(0, name="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(9, name="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(60, name="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(110, name="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(60, name="linear", **kw) == pytest.approx(0.55)
    assert lr_factor(500, name="linear", **kw) == pytest.approx(0.1)
    assert lr_factor(50, name="constant", **kw) == 1.0
    assert all(math.isfinite(lr_factor(s, name="cosine", **kw)) for s in range(200))
