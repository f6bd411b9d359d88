"""The parallel mesh: one explicit object that maps ranks to grid coordinates and owns every group.

Ranks form a grid with axes ``(pp, dp, cp, tp)``. The default rank order is row-major with TP
fastest, so the ranks of one TP group are consecutive and, with the usual ``torchrun`` rank
assignment, sit on one node where the fastest links are. A hardware-specific ring order is
expressed by passing another :class:`RankOrder`.

There is no module-global state: every function that needs a group receives the mesh (or the
group itself). The mesh also builds the *KV-shared* groups used by KV replication: within a TP
group of size ``T`` whose K/V projections run at degree ``T / m``, the ``m`` ranks holding the
same K/V shard form one KV-shared group.

Expert parallelism folds over data parallelism: with ``ep`` dividing ``dp``, the data-parallel
index ``d`` splits into ``(dp_expert, ep) = (d // ep, d % ep)``, so the expert view of the grid is
``[pp, dp_expert, ep, cp, tp]``. The ``ep`` ranks of one expert group (consecutive DP indices)
hold different experts and exchange tokens; the ``dp / ep`` ranks of one *expert-data-parallel*
group hold the same experts and average their gradients.

Hybrid sharding (``ranks_per_host``): ranks ``[h * n, (h + 1) * n)`` run on host ``h`` (torchrun's
assignment, ``n = LOCAL_WORLD_SIZE``), and each dp x cp group splits into its members on one host
(``dp_shard``: what ZeRO shards over with ``parallel.shard_over: host``) and the members at the
same position of those host parts (``dp_replicate``: the ranks that hold the same shard, across
hosts). Every host must hold the same number of members of every dp x cp group.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from plait.comm.primitives import GroupInfo

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
KV_PLACEMENTS = ("interleaved", "adjacent")


class MeshError(ValueError):
    """A parallel layout that cannot be built (degrees that do not fit the world size, ...)."""


class RankOrder(Protocol):
    """Strategy that decides which global rank sits at each grid coordinate.

    ``rank_of(coord, degrees)`` returns the global rank at ``coord`` (a dict axis -> index) for the
    grid ``degrees`` (a dict axis -> size). It must be a bijection onto ``range(world)``.
    """

    def rank_of(self, coord: dict[str, int], degrees: dict[str, int]) -> int: ...


@dataclass(frozen=True)
class RowMajorOrder:
    """Row-major over an axis order (default ``pp, dp, cp, tp``: the last axis varies fastest)."""

    order: tuple[str, ...] = AXES

    def rank_of(self, coord: dict[str, int], degrees: dict[str, int]) -> int:
        rank = 0
        for axis in self.order:
            rank = rank * degrees[axis] + coord[axis]
        return rank


def kv_shard_of_tp_rank(tp_rank: int, tp: int, kv_replication: int, placement: str) -> tuple[int, int]:
    """Return ``(kv_shard, replica)`` of a TP rank when K/V run at degree ``tp / kv_replication``.

    ``interleaved``: the K/V shards repeat around the TP group (rank r holds shard ``r % (T/m)``),
    which is what a replicated-then-sharded weight gives and needs a Q-head permutation on import.
    ``adjacent``: the ``m`` replicas of a shard are neighbouring ranks (shard ``r // m``).
    """
    kv_degree = tp // kv_replication
    if placement == "interleaved":
        return tp_rank % kv_degree, tp_rank // kv_degree
    if placement == "adjacent":
        return tp_rank // kv_replication, tp_rank % kv_replication
    raise MeshError(f"kv_placement={placement!r} is not valid; choose one of {KV_PLACEMENTS}")


class ParallelMesh:
    """Rank grid ``[pp, dp, cp, tp]`` with its process groups, built once.

    Args:
        world_size: total number of ranks; ``dp`` is derived from it when not given.
        rank: this process's global rank.
        tp, pp, dp, cp: parallel degrees.
        kv_replication: ``m``, the number of TP ranks that hold the same K/V heads (1 = none).
        kv_placement: ``"interleaved"`` or ``"adjacent"`` placement of the K/V replicas.
        rank_order: the strategy that places ranks on the grid (default row-major, TP fastest).
        create_groups: build ``torch.distributed`` groups (needs an initialised default group);
            ``False`` gives a pure rank-arithmetic mesh, useful for planning and tests.
        ranks_per_host: ranks per host, for the hybrid-sharding groups ``dp_shard`` and
            ``dp_replicate`` (``None``: not built).
    """

    def __init__(
        self,
        world_size: int,
        rank: int = 0,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        cp: int = 1,
        ep: int = 1,
        kv_replication: int = 1,
        kv_placement: str = "interleaved",
        rank_order: RankOrder | None = None,
        create_groups: bool = True,
        ranks_per_host: int | None = None,
    ) -> None:
        _check_positive(world_size=world_size, tp=tp, pp=pp, cp=cp, kv_replication=kv_replication)
        if dp is None:
            denom = tp * pp * cp
            if world_size % denom:
                raise MeshError(
                    f"world_size={world_size} is not divisible by tp*pp*cp={tp}*{pp}*{cp}={denom}; "
                    f"choose degrees whose product divides {world_size}"
                )
            dp = world_size // denom
        _check_positive(dp=dp)
        if tp * pp * dp * cp != world_size:
            raise MeshError(
                f"tp*pp*dp*cp = {tp}*{pp}*{dp}*{cp} = {tp * pp * dp * cp} does not equal "
                f"world_size={world_size}; the degrees must multiply to the world size"
            )
        _check_positive(ep=ep)
        if dp % ep:
            valid = [e for e in range(1, dp + 1) if dp % e == 0]
            raise MeshError(f"ep={ep} does not divide dp={dp}; expert parallelism folds over data parallelism, "
                            f"valid values: {valid}")
        if tp % kv_replication:
            valid = [m for m in range(1, tp + 1) if tp % m == 0]
            raise MeshError(
                f"kv_replication={kv_replication} does not divide tp={tp}; valid values: {valid}"
            )
        if kv_placement not in KV_PLACEMENTS:
            raise MeshError(f"kv_placement={kv_placement!r} is not valid; choose one of {KV_PLACEMENTS}")
        if not 0 <= rank < world_size:
            raise MeshError(f"rank={rank} is outside [0, world_size={world_size})")

        self.world_size = world_size
        self.rank = rank
        self.degrees: dict[str, int] = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        self.kv_replication = kv_replication
        self.kv_placement = kv_placement
        self.ep = ep
        self.rank_order: RankOrder = rank_order or RowMajorOrder()

        self._rank_at: dict[tuple[int, ...], int] = {}
        for coord in itertools.product(*(range(self.degrees[a]) for a in AXES)):
            r = self.rank_order.rank_of(dict(zip(AXES, coord, strict=True)), self.degrees)
            self._rank_at[coord] = r
        if sorted(self._rank_at.values()) != list(range(world_size)):
            raise MeshError(f"rank order {self.rank_order!r} is not a bijection onto range({world_size})")
        self._coord_of = {r: c for c, r in self._rank_at.items()}
        self.ranks_per_host = ranks_per_host
        if ranks_per_host is not None:
            self._check_hosts(ranks_per_host)

        self._groups: dict[str, dist.ProcessGroup | None] = {}
        if create_groups:
            self._build_groups()

    # ----------------------------------------------------------------- rank arithmetic
    @property
    def tp(self) -> int:
        return self.degrees["tp"]

    @property
    def pp(self) -> int:
        return self.degrees["pp"]

    @property
    def dp(self) -> int:
        return self.degrees["dp"]

    @property
    def cp(self) -> int:
        return self.degrees["cp"]

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Grid coordinates of ``rank`` (default: this rank) as ``{axis: index}``."""
        return dict(zip(AXES, self._coord_of[self.rank if rank is None else rank], strict=True))

    @property
    def tp_rank(self) -> int:
        return self.coords()["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords()["dp"]

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` (or ``"kv"`` for KV-shared groups), each a list of ranks."""
        if axis == "kv":
            return self._kv_group_ranks()
        if axis == "tied":
            return self._tied_group_ranks()
        if axis == "dp_cp":
            return self._dp_cp_group_ranks()
        if axis in ("ep", "dp_expert"):
            return self._expert_group_ranks(axis)
        if axis in ("dp_shard", "dp_replicate"):
            return self._host_group_ranks(axis)
        if axis not in AXES:
            raise MeshError(f"unknown mesh axis {axis!r}; valid: "
                            f"{AXES + ('kv', 'tied', 'dp_cp', 'ep', 'dp_expert', 'dp_shard', 'dp_replicate')}")
        others = [a for a in AXES if a != axis]
        groups = []
        for fixed in itertools.product(*(range(self.degrees[a]) for a in others)):
            base = dict(zip(others, fixed, strict=True))
            groups.append(
                [self._rank_at[tuple({**base, axis: i}[a] for a in AXES)] for i in range(self.degrees[axis])]
            )
        return sorted(groups)

    def _tied_group_ranks(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline group (tied embedding / output head)."""
        return sorted(sorted({g[0], g[-1]}) for g in self.group_ranks("pp"))

    def _dp_cp_group_ranks(self) -> list[list[int]]:
        """Ranks holding the same parameters and different data: the same pp and tp coordinates, any
        dp and cp. Parameter gradients are averaged over this group (it is the dp group when cp=1)."""
        groups = []
        for pp, tp in itertools.product(range(self.pp), range(self.tp)):
            # dp-major, cp-minor: with cp=1 exactly the dp groups, in their order
            groups.append([self._rank_at[tuple({"pp": pp, "dp": d, "cp": c, "tp": tp}[a] for a in AXES)]
                           for d in range(self.dp) for c in range(self.cp)])
        return sorted(groups)

    def _expert_group_ranks(self, axis: str) -> list[list[int]]:
        """Expert groups (``ep``: consecutive DP indices ``d // ep`` equal, holding different experts)
        or expert-data-parallel groups (``dp_expert``: the same ``d % ep``, holding the same experts)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for coord, r in sorted(self._rank_at.items()):
            c = dict(zip(AXES, coord, strict=True))
            within = c["dp"] // self.ep if axis == "ep" else c["dp"] % self.ep
            groups.setdefault((c["pp"], c["cp"], c["tp"], within), []).append(r)
        return sorted(sorted(g) for g in groups.values())

    def _host_parts(self, ranks_per_host: int) -> list[list[list[int]]]:
        """Each dp x cp group cut into its members on each host, hosts in order."""
        out = []
        for g in self._dp_cp_group_ranks():
            by_host: dict[int, list[int]] = {}
            for r in g:
                by_host.setdefault(r // ranks_per_host, []).append(r)
            out.append([by_host[h] for h in sorted(by_host)])
        return out

    def _check_hosts(self, ranks_per_host: int) -> None:
        _check_positive(ranks_per_host=ranks_per_host)
        if self.world_size % ranks_per_host:
            raise MeshError(f"world_size={self.world_size} is not a multiple of ranks_per_host={ranks_per_host}")
        for parts in self._host_parts(ranks_per_host):
            if len({len(p) for p in parts}) > 1:
                raise MeshError(f"the data-parallel group {sorted(r for p in parts for r in p)} has "
                                f"{[len(p) for p in parts]} members on its hosts; hybrid sharding needs the "
                                f"same number on every host")

    def _host_group_ranks(self, axis: str) -> list[list[int]]:
        """``dp_shard``: a dp x cp group's members on one host; ``dp_replicate``: its members at the
        same position of every host's part (see the module doc)."""
        if self.ranks_per_host is None:
            raise MeshError(f"axis {axis!r} needs ranks_per_host (hybrid sharding)")
        groups: list[list[int]] = []
        for parts in self._host_parts(self.ranks_per_host):
            groups.extend(parts if axis == "dp_shard" else [list(r) for r in zip(*parts, strict=True)])
        return sorted(groups)

    def _kv_group_ranks(self) -> list[list[int]]:
        groups: list[list[int]] = []
        for tp_group in self.group_ranks("tp"):
            by_shard: dict[int, list[int]] = {}
            for tp_rank, r in enumerate(tp_group):
                shard, _ = kv_shard_of_tp_rank(tp_rank, self.tp, self.kv_replication, self.kv_placement)
                by_shard.setdefault(shard, []).append(r)
            groups.extend(by_shard.values())
        return sorted(groups)

    def my_group_ranks(self, axis: str) -> list[int]:
        """The ranks of this rank's group along ``axis`` (``"kv"`` for its KV-shared group)."""
        for g in self.group_ranks(axis):
            if self.rank in g:
                return g
        if axis == "tied":  # a middle pipeline stage holds neither end of the tied weights
            return [self.rank]
        raise AssertionError("every rank belongs to exactly one group per axis")

    # ----------------------------------------------------------------- process groups
    def _build_groups(self) -> None:
        if not dist.is_initialized():
            raise MeshError("create_groups=True needs torch.distributed to be initialised first")
        if dist.get_world_size() != self.world_size:
            raise MeshError(
                f"world_size={self.world_size} does not match the initialised process group "
                f"({dist.get_world_size()} ranks)"
            )
        # Every rank must create every group in the same order (a torch.distributed rule).
        # dp_cp is built only when cp > 1; otherwise it is the dp group (see group())
        for axis in AXES + ("kv", "tied") + (("dp_cp",) if self.cp > 1 else ()) + (
                ("ep", "dp_expert") if self.ep > 1 else ()) + (
                ("dp_shard", "dp_replicate") if self.ranks_per_host is not None else ()):
            mine: dist.ProcessGroup | None = None
            for ranks in self.group_ranks(axis):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    mine = group
            self._groups[axis] = mine

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """This rank's group along ``axis``: ``"tp"``, ``"dp"``, ``"pp"``, ``"cp"``, ``"kv"`` (KV-shared),
        ``"tied"`` (first and last pipeline stage, for tied embeddings) or ``"dp_cp"`` (dp x cp:
        the ranks that average parameter gradients), ``"ep"`` (the expert group) or ``"dp_expert"``
        (the ranks holding the same experts; the dp group when ep=1)."""
        if not self._groups:
            raise MeshError("this mesh was built with create_groups=False; it has no process groups")
        if axis == "dp_cp" and self.cp == 1:
            axis = "dp"
        if axis == "dp_expert" and self.ep == 1:
            axis = "dp"
        return self._groups[axis]

    def info(self, axis: str) -> GroupInfo:
        """This rank's group along ``axis`` with its rank and size in it (group may be ``None``)."""
        ranks = self.my_group_ranks(axis)
        alias = "dp" if (axis == "dp_cp" and self.cp == 1) or (axis == "dp_expert" and self.ep == 1) else axis
        group = self._groups.get(alias) if len(ranks) > 1 else None
        return GroupInfo(group, ranks.index(self.rank), len(ranks))

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.group("tp")

    def __repr__(self) -> str:
        d = self.degrees
        return (
            f"ParallelMesh(world={self.world_size}, rank={self.rank}, pp={d['pp']}, dp={d['dp']}, "
            f"cp={d['cp']}, tp={d['tp']}, ep={self.ep}, kv_replication={self.kv_replication}, "
            f"kv_placement={self.kv_placement!r})"
        )


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise MeshError(f"{name}={value!r} must be a positive integer")


def single_process_mesh() -> ParallelMesh:
    """A 1-rank mesh without process groups, for the unsharded reference model."""
    return ParallelMesh(1, 0, create_groups=False)
