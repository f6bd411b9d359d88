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
are split into that group's size of shards (``Bucket.shards``; ``expert_shards``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    entries: list[ParamEntry] = field(default_factory=list)
    deferred: bool = False
    expert: bool = False  #: holds expert-parallel parameters (reduced over the expert-data-parallel group)
    shards: int = 1  #: how many owned ranges it splits into (the plan's, or the expert group's)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, shard: int, shards: int) -> tuple[int, int]:
        """The flat-buffer range owned by ``shard``."""
        size = self.numel // shards
        return self.start + shard * size, self.start + (shard + 1) * size


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
    shards: int

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def padding(self) -> int:
        """Elements added so every bucket splits evenly into shards."""
        return self.numel - sum(e.numel for e in self.entries)

    def owned_segments(self, shard: int, expert_shard: int | None = None) -> list[Segment]:
        """Every parameter segment inside shard ``shard``'s ranges (``expert_shard``'s in expert
        buckets; default ``shard``), in buffer order."""
        out = []
        for b in self.buckets:
            mine = expert_shard if b.expert and expert_shard is not None else shard
            lo, hi = b.shard_range(mine, b.shards)
            for e in b.entries:
                a, z = max(lo, e.start), min(hi, e.end)
                if a < z:
                    out.append(Segment(e, b, a, z))
        return out


def plan_buckets(params: list[tuple[str, torch.nn.Parameter, bool, float]], *, bucket_numel: int, shards: int,
                 deferred_names: frozenset[str] = frozenset(),
                 expert_names: frozenset[str] = frozenset(), expert_shards: int | None = None) -> BucketPlan:
    """Lay out ``params`` (name, parameter, decay, norm weight), given in registration order.

    ``bucket_numel`` caps a bucket (a larger parameter gets a bucket of its own).
    """
    if bucket_numel < 1 or shards < 1:
        raise ValueError(f"bucket_numel={bucket_numel} and shards={shards} must be positive")
    entries: list[ParamEntry] = []
    buckets: list[Bucket] = []
    ordered = list(reversed(params))
    regular = [p for p in ordered if p[0] not in deferred_names and p[0] not in expert_names]
    deferred = [p for p in ordered if p[0] in deferred_names]
    experts = [p for p in ordered if p[0] in expert_names and p[0] not in deferred_names]
    offset = 0
    for group, is_deferred, is_expert in ((regular, False, False), (experts, False, True), (deferred, True, False)):
        count = expert_shards if is_expert and expert_shards is not None else shards
        current: Bucket | None = None
        for name, param, decay, weight in group:
            n = param.numel()
            if current is not None and current.entries and (offset - current.start) + n > bucket_numel:
                offset = _close(current, offset, count)
                current = None
            if current is None:
                current = Bucket(len(buckets), offset, offset, deferred=is_deferred, expert=is_expert, shards=count)
                buckets.append(current)
            entry = ParamEntry(name, param, offset, n, current.index, decay, weight)
            current.entries.append(entry)
            entries.append(entry)
            offset += n
        if current is not None:
            offset = _close(current, offset, count)
    return BucketPlan(entries, buckets, shards)


def _close(bucket: Bucket, offset: int, shards: int) -> int:
    """Pad the bucket ending at ``offset`` to a multiple of ``shards``; returns the next offset."""
    size = offset - bucket.start
    size += (-size) % shards
    bucket.end = bucket.start + max(size, shards)
    return bucket.end
