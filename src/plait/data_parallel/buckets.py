"""Where every gradient lives in the flat data-parallel buffer, and which part of it a rank owns.

The parameters of a rank are laid out back to back in one flat buffer per step, in *reverse*
registration order, which approximates the order in which backward produces their gradients.
Consecutive parameters are grouped into buckets of about ``bucket_numel`` elements; a bucket is
the unit of communication, so its reduction can start as soon as its last gradient is ready.

Each bucket is padded to a multiple of the number of shards ``S`` (the data-parallel degree with
ZeRO-1, 1 without) and split into ``S`` equal, contiguous shards; shard ``r`` is owned by
data-parallel rank ``r``, which holds the optimizer state (and master weights) of exactly that
range. A parameter can straddle shard boundaries, so the optimizer works on *segments*: the
intersection of one parameter with one owned range.

Parameters named in ``deferred_names`` (an embedding tied across pipeline stages, whose gradient
must be summed over the stages before it is reduced over data parallelism) get buckets of their
own, which are reduced only at the end of backward.

Parameters named in ``expert_names`` (routed experts under expert parallelism, which differ
between the ranks of an expert group) also get buckets of their own, marked ``expert``: their
data-parallel reduction runs over the expert-data-parallel group instead, and under ZeRO-1 they
are split into that group's size of shards.

Each bucket carries what its reduction needs, decided here once: the group it is reduced (and
sharded) over (``Bucket.group``), its shard count and the shard this rank owns, so the gradient
reduction and the optimizer ask the bucket instead of telling expert buckets apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plait.comm.primitives import GroupInfo


@dataclass
class ParamEntry:
    """One parameter's place in the flat buffer."""

    name: str
    param: torch.nn.Parameter
    start: int  #: offset of the parameter's first element in the flat buffer
    numel: int
    bucket: int
    decay: bool  #: receives weight decay
    norm_weight: float  #: weight of its squared gradient in the global norm (0 = counted elsewhere)

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass
class Bucket:
    """A contiguous range ``[start, end)`` of the flat buffer; ``end - start`` divides by the shard count."""

    index: int
    start: int
    end: int
    group: GroupInfo  #: the data-parallel group it is reduced over (the expert-data-parallel one for experts)
    shards: int = 1  #: how many owned ranges it splits into: the size of ``group`` under ZeRO-1, else 1
    shard: int = 0  #: the owned range of this rank: its rank in ``group`` under ZeRO-1, else 0
    entries: list[ParamEntry] = field(default_factory=list)
    deferred: bool = False
    expert: bool = False  #: holds expert-parallel parameters (their squares are added over the expert group)
    unit: int = -1  #: the ZeRO-3 gathering unit its parameters belong to (-1: no units were given)
    #: hybrid sharding: the ranks holding the same owned chunk on other hosts, over which the chunk's
    #: reduced gradient is summed after ``group``'s reduction (None: ``group`` is every replica)
    replicas: GroupInfo | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def owned_range(self) -> tuple[int, int]:
        """The flat-buffer range this rank owns (the whole bucket without ZeRO-1)."""
        size = self.numel // self.shards
        return self.start + self.shard * size, self.start + (self.shard + 1) * size


@dataclass
class Segment:
    """The part ``[start, end)`` (flat-buffer offsets) of one parameter inside one owned range."""

    entry: ParamEntry
    bucket: Bucket
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class BucketPlan:
    """Every parameter's place in the flat buffer and the buckets that cover it."""

    entries: list[ParamEntry]
    buckets: list[Bucket]

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def padding(self) -> int:
        """Elements added so every bucket splits evenly into shards."""
        return self.numel - sum(e.numel for e in self.entries)

    def owned_chunks(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One zeroed flat buffer holding this rank's owned chunk of every bucket, in bucket order,
        and its view per bucket (ZeRO-2/3 keep gradients and weights this way)."""
        sizes = [b.numel // b.shards for b in self.buckets]
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        return flat, list(flat.split(sizes)) if sizes else []

    def owned_segments(self) -> list[Segment]:
        """Every parameter segment inside this rank's owned ranges, in buffer order."""
        out = []
        for b in self.buckets:
            lo, hi = b.owned_range
            for e in b.entries:
                a, z = max(lo, e.start), min(hi, e.end)
                if a < z:
                    out.append(Segment(e, b, a, z))
        return out


def plan_buckets(params: list[tuple[str, torch.nn.Parameter, bool, float]], *, bucket_numel: int, dp: GroupInfo,
                 sharded: bool, deferred_names: frozenset[str] = frozenset(),
                 expert_names: frozenset[str] = frozenset(), expert_dp: GroupInfo | None = None,
                 unit_of: dict[str, int] | None = None, replicas: GroupInfo | None = None) -> BucketPlan:
    """Lay out ``params`` (name, parameter, decay, norm weight), given in registration order.

    ``bucket_numel`` caps a bucket (a larger parameter gets a bucket of its own). Buckets are
    reduced over ``dp``, the experts' over ``expert_dp`` (default ``dp``); ``sharded`` (ZeRO-1 and
    up) splits each bucket into its group's size of shards, of which this rank owns the one at its
    rank in the group.

    ``unit_of`` (ZeRO-3: parameter name -> gathering unit) closes a bucket wherever the unit
    changes, so that no bucket spans two units and a unit's parameters can be gathered and freed
    together; ``bucket_numel`` is then ignored (one bucket per unit and kind: one gather each).

    ``replicas`` (hybrid sharding: ``dp`` is then the data-parallel ranks of one host) is the group
    of the other hosts' ranks holding the same shards; it goes on every non-expert bucket.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel} must be positive")
    entries: list[ParamEntry] = []
    buckets: list[Bucket] = []
    ordered = list(reversed(params))
    regular = [p for p in ordered if p[0] not in deferred_names and p[0] not in expert_names]
    deferred = [p for p in ordered if p[0] in deferred_names]
    experts = [p for p in ordered if p[0] in expert_names and p[0] not in deferred_names]
    offset = 0
    experts_group = expert_dp if expert_dp is not None else dp
    for members, group, is_deferred, is_expert in ((regular, dp, False, False), (experts, experts_group, False, True),
                                                   (deferred, dp, True, False)):
        count, mine = (group.size, group.rank) if sharded else (1, 0)
        current: Bucket | None = None
        for name, param, decay, weight in members:
            n = param.numel()
            unit = -1 if unit_of is None else unit_of[name]
            if unit_of is not None:
                full = current is not None and current.unit != unit
            else:
                full = current is not None and (offset - current.start) + n > bucket_numel
            if current is not None and current.entries and full:
                offset = _close(current, offset, count)
                current = None
            if current is None:
                current = Bucket(len(buckets), offset, offset, group, shards=count, shard=mine, deferred=is_deferred,
                                 expert=is_expert, unit=unit,
                                 replicas=replicas if replicas is not None and replicas.size > 1 and not is_expert
                                 else None)
                buckets.append(current)
            entry = ParamEntry(name, param, offset, n, current.index, decay, weight)
            current.entries.append(entry)
            entries.append(entry)
            offset += n
        if current is not None:
            offset = _close(current, offset, count)
    return BucketPlan(entries, buckets)


def _close(bucket: Bucket, offset: int, shards: int) -> int:
    """Pad the bucket ending at ``offset`` to a multiple of ``shards``; returns the next offset."""
    size = offset - bucket.start
    size += (-size) % shards
    bucket.end = bucket.start + max(size, shards)
    return bucket.end
