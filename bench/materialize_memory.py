"""Peak host memory per rank while building a ~2.2 GB fp32 Llama at TP=2 x PP=2 (4 gloo ranks).

Compares plait's delayed materialization (meta device, then only the rank's shard allocated and
initialised block by block) with the eager alternative (every rank builds and initialises the
full model, then cuts its shard). Prints peak RSS growth over the bare runtime per rank.

    python bench/materialize_memory.py
    python bench/materialize_memory.py --zero3   # ZeRO-3's shard-only build vs whole-then-adopt
"""

from __future__ import annotations

import os
import resource
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from distributed import run_distributed  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _worker(rank, world, eager):
    import torch

    from plait.materialize import build_stages
    from plait.mesh import ParallelMesh
    from plait.models.llama import LlamaConfig, LlamaForCausalLM
    from plait.plan.pipeline_split import plan_partition

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256)
    mesh = ParallelMesh(world, rank, tp=2, pp=2)
    layers = plan_partition(cfg, 2, 256).stage_layers()
    base = _rss()
    if eager:  # what a naive build does: the whole model on every rank first
        full = LlamaForCausalLM(cfg)
        torch.nn.init.normal_(full.lm_head.weight)
        del full
    stages = build_stages(cfg, mesh, layers, seed=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(p.numel() * p.element_size() for s in stages for p in s.parameters())
    return (peak - base) / 2**20, shard / 2**20


def _zero3_table() -> None:
    """ZeRO-3's weight build at DP=2 (a 166M-parameter fp32 Llama): placeholders filled range by range
    (plait's shard-only build) vs the whole local model built, then its owned chunks taken."""
    from test_deferred_build import _peak_weight_build

    print("| ZeRO-3 weight build (DP=2) | rank | weight shard MiB | peak RSS growth MiB | growth / shard |")
    print("|---|---:|---:|---:|---:|")
    for deferred in (True, False):
        name = "shard only (plait.deferred)" if deferred else "whole local model, then adopt"
        for rank, r in enumerate(run_distributed(_peak_weight_build, 2, deferred)):
            growth, shard = r["growth"] / 2**20, r["shard"] / 2**20
            print(f"| {name} | {rank} | {shard:.0f} | {growth:.0f} | {growth / shard:.2f} |")


if __name__ == "__main__":
    if "--zero3" in sys.argv:
        _zero3_table()
        sys.exit(0)
    print("| build | rank | shard MiB | peak RSS growth MiB | growth / shard |")
    print("|---|---:|---:|---:|---:|")
    for eager in (False, True):
        for rank, (growth, shard) in enumerate(run_distributed(_worker, 4, eager)):
            name = "eager full model, then shard" if eager else "delayed (plait)"
            print(f"| {name} | {rank} | {shard:.0f} | {growth:.0f} | {growth / shard:.2f} |")
