"""Hybrid sharding (``parallel.shard_over: host``): ZeRO shards over the data-parallel ranks of one
host and replicates across hosts; gradients are reduced inside the host, then across the hosts.

Hosts are torchrun's ``LOCAL_WORLD_SIZE`` consecutive ranks. Here 4 gloo ranks on this machine are
told they run 2 per host (the two-host test in network namespaces is in tests/test_multihost.py):
each level trained with hybrid sharding equals plain ZeRO-1 over all 4 ranks (itself checked
against one process in tests/test_dp_parity.py) to 1e-5 over 4 steps, and its sharded states are
1/2 of the whole (the host's two ranks), not 1/4.
"""

from __future__ import annotations

import pytest

from plait.config import RecipeError, validate_recipe
from plait.mesh import MeshError, ParallelMesh
from trainer_runs import corpus_dir, max_relative, run_recipe

BASE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
        "data.micro_batch_size=2", "parallel.sequence_parallel=false", "optimizer.grad_clip=1.0",
        "scheduler.warmup_steps=1", "optimizer.lr=1.5e-3", "parallel.tp=1", "logging.progress_bar=false",
        "logging.tensorboard=false", "parallel.bucket_mb=0.05", "parallel.dp=4"]
STEPS = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


def test_host_groups_split_each_data_parallel_group():
    def groups(axis, **kw):
        return ParallelMesh(8, 0, create_groups=False, ranks_per_host=4, **kw).group_ranks(axis)

    assert groups("dp_shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("dp_shard", tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups("dp_replicate", tp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(MeshError, match="same number on every host"):  # dp group [0, 3, 6, 9] on hosts 0, 0, 1, 2
        ParallelMesh(12, 0, tp=3, create_groups=False, ranks_per_host=4)
    with pytest.raises(MeshError, match="not a multiple"):
        ParallelMesh(6, 0, create_groups=False, ranks_per_host=4)
    with pytest.raises(MeshError, match="needs ranks_per_host"):
        ParallelMesh(8, 0, create_groups=False).group_ranks("dp_shard")


@pytest.mark.parametrize("level", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                   3])
def test_hybrid_levels_match_zero1_over_every_rank(corpus, tmp_path, monkeypatch, level):
    ref = run_recipe(corpus, tmp_path / "flat", BASE + ["parallel.zero=1"], 4, STEPS)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # inherited by the spawned ranks: 2 "hosts" of 2
    got = run_recipe(corpus, tmp_path / "hybrid", BASE + [f"parallel.zero={level}", "parallel.shard_over=host"],
                     4, STEPS)
    assert ref[0]["losses"][-1] < ref[0]["losses"][0], "the run must learn for the comparison to mean anything"
    rel = max_relative(got[0]["losses"], ref[0]["losses"])
    assert rel <= 1e-5, f"hybrid ZeRO-{level} vs ZeRO-1: {rel:.2e}\n{got[0]['losses']}\n{ref[0]['losses']}"
    assert max_relative(got[0]["norms"], ref[0]["norms"]) <= 1e-5
    for r in got:
        m = r["memory"]
        whole = m["total_elements"]
        assert abs(m["owned_elements"] - whole / 2) <= whole * 0.01, "states are sharded over the host's 2 ranks"
        if level >= 2:
            assert m["grad_bytes"] == whole // 2 * 4


def test_hybrid_rules():
    with pytest.raises(RecipeError) as err:
        validate_recipe({"parallel": {"zero": 1, "dp": 4, "ep": 2, "shard_over": "host"},
                         "model": {"family": "mixtral", "num_local_experts": 4}}, 4)
    assert "parallel.shard_over" in str(err.value) and "parallel.ep=2" in str(err.value)
    with pytest.raises(RecipeError) as err:  # nothing is sharded at level 0
        validate_recipe({"parallel": {"dp": 4, "shard_over": "host"}}, 4)
    assert "parallel.shard_over" in str(err.value) and "ZeRO level is 0" in str(err.value)
