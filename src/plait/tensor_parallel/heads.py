"""Placement of attention heads over a tensor-parallel group: padding and KV replication.

Terms: ``T`` the TP degree, ``H`` query heads, ``KV`` key/value heads, ``g = H / KV`` query heads
per KV head, ``m`` the KV replication factor. K/V projections run at degree ``T / m``: the KV
heads are split into ``T / m`` shards and each shard is held by ``m`` TP ranks (its KV-shared
group). A KV head's ``g`` query heads are split over its ``m`` replicas, so each rank only needs
the K/V heads its own query heads attend to.

When ``T`` does not divide ``H``, heads are padded: each KV group's query list is padded to a
multiple of ``m`` and, when needed, whole padding KV groups are added. Padding heads have zero
weights and their attention output is masked to zero, so they change neither outputs nor
gradients of real heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from plait.mesh import KV_PLACEMENTS, kv_shard_of_tp_rank


class HeadLayoutError(ValueError):
    """A TP degree / KV replication factor that cannot place the attention heads."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class HeadLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp: int
    kv_replication: int
    placement: str = "interleaved"

    @staticmethod
    def plan(num_heads: int, num_kv_heads: int, head_dim: int, tp: int,
             kv_replication: int | None = None, placement: str = "interleaved") -> HeadLayout:
        """Validate the degrees and pick the replication factor when it is not given.

        Without padding (``T`` divides ``H``) the automatic factor is ``T / gcd(T, KV)``, the
        smallest that needs no padding. With padding, the factor that pads fewest heads.
        """
        if placement not in KV_PLACEMENTS:
            raise HeadLayoutError(f"kv_placement={placement!r} is not valid; choose one of {KV_PLACEMENTS}")
        if tp > num_heads:
            raise HeadLayoutError(
                f"tp={tp} exceeds num_attention_heads={num_heads}: some rank would hold only padding "
                f"heads; use tp <= {num_heads} (tp values dividing the heads: {_divisors(num_heads)})"
            )
        padded = num_heads % tp != 0
        valid = HeadLayout.valid_replications(num_heads, num_kv_heads, tp)
        if kv_replication is None:
            if not padded:
                kv_replication = tp // math.gcd(tp, num_kv_heads)
            else:
                kv_replication = min(valid, key=lambda m: (
                    HeadLayout(num_heads, num_kv_heads, head_dim, tp, m, placement).padded_num_heads, m))
        elif kv_replication not in valid:
            raise HeadLayoutError(
                f"kv_replication={kv_replication} is not valid for tp={tp}, "
                f"num_attention_heads={num_heads}, num_key_value_heads={num_kv_heads}; valid values: {valid}"
                + ("" if padded else
                   " (it must divide tp, tp/kv_replication must divide the KV heads, and it must "
                   "divide the query heads per KV head)")
            )
        return HeadLayout(num_heads, num_kv_heads, head_dim, tp, kv_replication, placement)

    @staticmethod
    def valid_replications(num_heads: int, num_kv_heads: int, tp: int) -> list[int]:
        if num_heads % tp:
            return _divisors(tp)
        g = num_heads // num_kv_heads
        return [m for m in _divisors(tp) if num_kv_heads % (tp // m) == 0 and g % m == 0]

    # ------------------------------------------------------------------ derived sizes
    @property
    def kv_degree(self) -> int:
        return self.tp // self.kv_replication

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def padded_group_size(self) -> int:
        return _round_up(self.group_size, self.kv_replication)

    @property
    def padded_num_kv_heads(self) -> int:
        return _round_up(self.num_kv_heads, self.kv_degree)

    @property
    def padded_num_heads(self) -> int:
        return self.padded_num_kv_heads * self.padded_group_size

    @property
    def local_kv_heads(self) -> int:
        return self.padded_num_kv_heads // self.kv_degree

    @property
    def local_q_heads(self) -> int:
        return self.local_kv_heads * self.padded_group_size // self.kv_replication

    # ------------------------------------------------------------------ per-rank head lists
    @cached_property
    def _assignments(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        g, gp, m = self.group_size, self.padded_group_size, self.kv_replication
        per_replica = gp // m
        out = []
        for r in range(self.tp):
            shard, replica = kv_shard_of_tp_rank(r, self.tp, m, self.placement)
            kv_ids = [shard * self.local_kv_heads + j for j in range(self.local_kv_heads)]
            q_ids: list[int] = []
            for kv in kv_ids:
                group = [kv * g + i if (kv < self.num_kv_heads and i < g) else -1 for i in range(gp)]
                q_ids.extend(group[replica * per_replica:(replica + 1) * per_replica])
            kv_ids = [kv if kv < self.num_kv_heads else -1 for kv in kv_ids]
            out.append((tuple(q_ids), tuple(kv_ids)))
        return out

    def q_heads(self, tp_rank: int) -> tuple[int, ...]:
        """Global query-head ids held by ``tp_rank`` in local order (-1 = padding)."""
        return self._assignments[tp_rank][0]

    def kv_heads(self, tp_rank: int) -> tuple[int, ...]:
        """Global KV-head ids held by ``tp_rank`` in local order (-1 = padding)."""
        return self._assignments[tp_rank][1]

    def q_rows(self, tp_rank: int) -> tuple[int, ...]:
        return _expand(self.q_heads(tp_rank), self.head_dim)

    def kv_rows(self, tp_rank: int) -> tuple[int, ...]:
        return _expand(self.kv_heads(tp_rank), self.head_dim)

    def grouped_rows(self, tp_rank: int, parts: int) -> tuple[int, ...]:
        """Rows of ``tp_rank``'s share of a fused projection laid out head by head, each head
        ``parts`` consecutive blocks of ``head_dim`` rows (GPT-NeoX's ``query_key_value``: per head
        ``[q, k, v]``, ``parts = 3``), so a rank holds whole heads with all their parts. Only
        without grouped-query attention and KV replication (each query head owns its K/V head)."""
        if self.num_kv_heads != self.num_heads or self.kv_replication != 1:
            raise HeadLayoutError(f"a head-grouped fused projection needs one K/V head per query head and no KV "
                                  f"replication; got num_attention_heads={self.num_heads}, num_key_value_heads="
                                  f"{self.num_kv_heads}, kv_replication={self.kv_replication}")
        return _expand(self.q_heads(tp_rank), parts * self.head_dim)

    def real_q_mask(self, tp_rank: int) -> tuple[bool, ...]:
        return tuple(h >= 0 for h in self.q_heads(tp_rank))

    @property
    def needs_padding(self) -> bool:
        return self.padded_num_heads != self.num_heads


def _expand(heads: tuple[int, ...], head_dim: int) -> tuple[int, ...]:
    return tuple(h * head_dim + d if h >= 0 else -1 for h in heads for d in range(head_dim))
