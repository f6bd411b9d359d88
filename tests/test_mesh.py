"""ParallelMesh: golden group lists, fake-process-group construction, and bad layouts."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from plait.mesh import MeshError, ParallelMesh, RowMajorOrder


def _mesh(world, **kw):
    return ParallelMesh(world, 0, create_groups=False, **kw)


def test_tp8_pp4_groups():
    m = _mesh(32, tp=8, pp=4)
    assert m.dp == 1
    assert m.group_ranks("tp") == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert m.group_ranks("pp") == [[i, i + 8, i + 16, i + 24] for i in range(8)]
    assert m.group_ranks("dp") == [[i] for i in range(32)]
    assert m.coords(13) == {"pp": 1, "dp": 0, "cp": 0, "tp": 5}
    assert m.group_ranks("tied") == [[i, i + 24] for i in range(8)]


def test_tp2_pp2_dp4_groups():
    m = _mesh(16, tp=2, pp=2, dp=4)
    assert m.group_ranks("tp") == [[i, i + 1] for i in range(0, 16, 2)]
    assert m.group_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert m.group_ranks("pp") == [[i, i + 8] for i in range(8)]
    assert m.coords(11) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}


def test_dp_derived_and_cp_axis():
    m = _mesh(16, tp=2, cp=2)
    assert m.dp == 4
    expected = [[i, i + 2] for i in range(0, 16, 4)] + [[i + 1, i + 3] for i in range(0, 16, 4)]
    assert m.group_ranks("cp") == sorted(expected)


@pytest.mark.parametrize(
    "placement,expected",
    [("interleaved", [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]),
     ("adjacent", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]])],
)
def test_kv_shared_groups(placement, expected):
    m = _mesh(16, tp=8, kv_replication=4, kv_placement=placement)
    assert m.group_ranks("kv") == expected


def test_kv_groups_without_replication_are_singletons():
    assert _mesh(4, tp=4).group_ranks("kv") == [[0], [1], [2], [3]]


def test_custom_rank_order_dp_fastest():
    m = _mesh(8, tp=2, dp=4, rank_order=RowMajorOrder(order=("pp", "cp", "tp", "dp")))
    assert m.group_ranks("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.group_ranks("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


class _Broken:
    def rank_of(self, coord, degrees):
        return 0


def test_rank_order_must_be_bijection():
    with pytest.raises(MeshError, match="bijection"):
        _mesh(4, tp=2, rank_order=_Broken())


@pytest.mark.parametrize(
    "world,kw,needle",
    [(12, dict(tp=8), "tp\\*pp\\*cp=8\\*1\\*1=8"),
     (16, dict(tp=2, pp=2, dp=3), "tp\\*pp\\*dp\\*cp = 2\\*2\\*3\\*1 = 12"),
     (8, dict(tp=4, kv_replication=3), "kv_replication=3 does not divide tp=4; valid values: \\[1, 2, 4\\]"),
     (8, dict(tp=0), "tp=0 must be a positive integer"),
     (8, dict(tp=2, kv_placement="ring"), "kv_placement='ring'")],
)
def test_bad_layouts_name_the_degrees(world, kw, needle):
    with pytest.raises(MeshError, match=needle):
        _mesh(world, **kw)


def test_groups_on_fake_process_group():
    """Every group is created in one process with the fake backend (no data moves)."""
    world = 32
    for rank in (0, 13, 31):
        dist.init_process_group("fake", rank=rank, world_size=world)
        try:
            m = ParallelMesh(world, rank, tp=8, pp=4, kv_replication=2)
            for axis in ("tp", "pp", "dp", "kv"):
                assert dist.get_process_group_ranks(m.group(axis)) == m.my_group_ranks(axis)
            info = m.info("tp")
            assert (info.rank, info.size) == (rank % 8, 8)
        finally:
            dist.destroy_process_group()
