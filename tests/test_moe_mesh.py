"""The expert view of the mesh: golden expert and expert-data-parallel groups, on rank arithmetic
and on the fake process group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from plait.mesh import MeshError, ParallelMesh


def _mesh(world, **kw):
    return ParallelMesh(world, 0, create_groups=False, **kw)


def test_ep2_folds_over_dp4():
    m = _mesh(8, dp=4, tp=2, ep=2)  # dp index d -> (dp_expert, ep) = (d // 2, d % 2)
    assert m.group_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m.group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.group_ranks("dp_expert") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_pp2_dp4_ep4_and_ep1():
    m = _mesh(8, pp=2, dp=4, ep=4)
    assert m.group_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.group_ranks("dp_expert") == [[i] for i in range(8)]
    plain = _mesh(8, pp=2, dp=4)
    assert plain.group_ranks("ep") == [[i] for i in range(8)]
    assert plain.group_ranks("dp_expert") == plain.group_ranks("dp")


def test_every_rank_is_in_one_expert_and_one_expert_dp_group_whose_product_is_its_dp_group():
    m = _mesh(16, pp=2, dp=4, tp=2, ep=2)
    for r in range(16):
        ep = next(g for g in m.group_ranks("ep") if r in g)
        edp = next(g for g in m.group_ranks("dp_expert") if r in g)
        dp = next(g for g in m.group_ranks("dp") if r in g)
        assert set(ep) | set(edp) <= set(dp) and len(ep) * len(edp) == len(dp) and set(ep) & set(edp) == {r}


def test_ep_must_divide_dp():
    with pytest.raises(MeshError, match=r"ep=3 does not divide dp=4.*valid values: \[1, 2, 4\]"):
        _mesh(4, ep=3)


def test_groups_on_the_fake_process_group():
    for rank in (0, 7):
        dist.init_process_group("fake", rank=rank, world_size=8)
        try:
            m = ParallelMesh(8, rank, dp=4, tp=2, ep=2)
            assert m.info("ep").size == 2 and m.info("dp_expert").size == 2
            assert m.my_group_ranks("ep") == ([0, 2] if rank == 0 else [5, 7])
            assert m.my_group_ranks("dp_expert") == ([0, 4] if rank == 0 else [3, 7])
            assert m.info("ep").rank == (0 if rank == 0 else 1)
            assert m.group("ep") is not None and m.group("dp_expert") is not None
        finally:
            dist.destroy_process_group()
