"""Delayed materialization: each rank allocates only its own shard of its own stages.

* Initial weights assembled from TP=2 x PP=2 equal one process's, bitwise.
* Peak host memory (RSS) of each rank while building a ~2.2 GB fp32 model at TP=2 x PP=2 stays
  within 1.3 x the rank's own shard above the bare runtime's footprint (the process after
  importing torch and joining the process group). Initialisation draws fixed 16 MB blocks, so
  the transient cost is one block, never a full parameter.
"""

from __future__ import annotations

import resource

import pytest
import torch

from distributed import run_distributed


def _tiny(tied):
    from plait.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=5,
                       num_attention_heads=6, num_key_value_heads=2, attention_bias=True,
                       tie_word_embeddings=tied, max_position_embeddings=32)


def _stage_weights(rank, world, tied):
    from builders import build_llama_stages
    from plait.mesh import ParallelMesh
    from plait.models.llama.parallelize import kv_replication_for
    from plait.parallel_state import full_state_dict
    from stage_layers import stage_layer_lists

    cfg = _tiny(tied)
    mesh = ParallelMesh(world, rank, tp=2, pp=2, kv_replication=kv_replication_for(cfg, 2))
    stages = build_llama_stages(cfg, mesh, stage_layer_lists(cfg, 2, 16), seed=11)
    out = {}
    for stage in stages:
        out.update(full_state_dict(stage, mesh.info("tp")))
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tp2_pp2_initial_weights_equal_one_process(tied):
    from builders import build_llama
    from plait.mesh import single_process_mesh

    ref = {k: v.detach() for k, v in build_llama(_tiny(tied), single_process_mesh(), seed=11).named_parameters()}
    merged = {}
    for weights in run_distributed(_stage_weights, 4, tied):
        for name, t in weights.items():
            if name in merged:  # a tied embedding appears on the first and the last stage
                assert torch.equal(merged[name], t), name
            merged[name] = t
    assert set(merged) == set(ref)
    for name, t in ref.items():
        assert torch.equal(merged[name], t), name


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_build_memory(rank, world):
    from builders import build_llama_stages
    from plait.mesh import ParallelMesh
    from plait.models.llama import LlamaConfig
    from stage_layers import stage_layer_lists

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256)
    mesh = ParallelMesh(world, rank, tp=2, pp=2)
    layers = stage_layer_lists(cfg, 2, 256)
    # a tiny build first: what the first build imports and compiles (on a fresh checkout, the
    # bytecode of every module it touches) is not the shard's memory
    tiny = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    build_llama_stages(tiny, mesh, stage_layer_lists(tiny, 2, 16), seed=0)
    baseline = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stages = build_llama_stages(cfg, mesh, layers, seed=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(p.numel() * p.element_size() for s in stages for p in s.parameters())
    return {"baseline": baseline, "peak": max(peak, peak_before), "shard": shard,
            "model_bytes": cfg.num_parameters() * 4}


def test_each_rank_allocates_only_its_shard():
    results = run_distributed(_peak_build_memory, 4)
    assert 2.0e9 < results[0]["model_bytes"] < 2.6e9
    for rank, r in enumerate(results):
        growth = r["peak"] - r["baseline"]
        assert r["shard"] < 0.35 * r["model_bytes"], f"rank {rank} holds more than its quarter"
        assert growth <= 1.3 * r["shard"], (
            f"rank {rank}: peak RSS grew by {growth / 2**20:.0f} MiB for a {r['shard'] / 2**20:.0f} MiB shard")
