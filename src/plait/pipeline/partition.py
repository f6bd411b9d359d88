"""Split a model's units (see :mod:`plait.pipeline.trace`) into contiguous pipeline stages.

A pipeline runs as fast as its slowest stage, so the partitioner minimises the largest stage
cost. The embedding is pinned to the first stage and the final norm and output head to the last
(the runtime builds exactly those stages), and every stage holds at least one block; only the
positions of the boundaries between blocks are chosen. A large vocabulary therefore makes the end
stages expensive, and the balanced split gives them fewer blocks than an even split by layer count.

Costs come from :func:`unit_costs` (parameters or per-token training FLOPs, from the model
config) or from a short measured profile (:func:`measure_unit_times`).
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.pipeline.trace import Unit

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from plait.models.decoder.config import DecoderConfig

PARTITION_METHODS = ("balanced", "even", "manual")
COST_KINDS = ("params", "flops")


class PartitionError(ValueError):
    """A partition request that cannot be satisfied (names the value and what is valid)."""


# ------------------------------------------------------------------------------------------ costs
def unit_costs(model_config: DecoderConfig, units: list[Unit], seq_len: int | None = None,
               kind: str = "params") -> list[float]:
    """Cost of each unit for a model config of any family (``layer_parameters()`` sizes a block,
    ``attention_span(seq_len)`` the keys each query's attention is counted over).

    ``kind="params"``: parameter count. Embedding and head are ``vocab * hidden`` each (the head
    counts even when tied to the embedding: its matmul and its gradient still run on its stage),
    the final norm its parameters (``final_norm_parameters()``: ``hidden`` for an RMSNorm, twice that
    for a layer norm with a bias), a block its ``layer_parameters()``.
    ``kind="flops"``: training FLOPs per token (forward + backward = 3 x forward). Matmul units
    cost 6 x their parameters; a block adds ``6 * attention_matmul_width() * seq_len`` for
    attention scores and values (``12 * heads * head_dim * seq_len`` when keys and values have the
    head's width; ``seq_len`` required); the head costs ``6 * vocab * hidden``; the embedding
    lookup, norms and other units (rotary tables, loss) count 0.
    The modules the model runs after its last layer (``tail_layer_ids()``, DeepSeek-V3's
    multi-token prediction) go with the head: each is one more block and one more pass through
    the head, plus ``tail_extra_parameters()`` (its ``2h -> h`` projection and norms).
    """
    if kind not in COST_KINDS:
        raise PartitionError(f"cost kind={kind!r} is not valid; valid: {', '.join(map(repr, COST_KINDS))}")
    if kind == "flops" and (not isinstance(seq_len, int) or seq_len < 1):
        raise PartitionError(f"seq_len={seq_len!r} must be a positive integer for kind='flops'")
    c = model_config
    h, v = c.hidden_size, c.vocab_size
    block = c.layer_parameters()
    tail = len(c.tail_layer_ids())
    costs = []
    for unit in units:
        if kind == "params":
            cost = {"embedding": v * h, "block": block, "norm": c.final_norm_parameters(),
                    "head": v * h + tail * block + c.tail_extra_parameters()}.get(unit.kind, 0)
        else:
            assert seq_len is not None  # kind == "flops": checked above
            block_flops = 6 * block + 6 * c.attention_matmul_width() * c.attention_span(seq_len)
            head_flops = 6 * v * h
            tail_flops = tail * (block_flops + head_flops) + 6 * c.tail_extra_parameters()
            cost = {"block": block_flops, "head": head_flops + tail_flops}.get(unit.kind, 0)
        costs.append(float(cost))
    return costs


def measure_unit_times(model: nn.Module, units: list[Unit], example_inputs: torch.Tensor | tuple[Any, ...],
                       kwargs: dict[str, Any] | None = None, *,
                       warmup: int = 1, iters: int = 3) -> list[float]:
    """Seconds per unit for one forward + backward, from a short profile of ``model`` on one device.

    One forward of the whole model (without grad) records each unit's inputs; then each unit is run
    alone ``warmup + iters`` times: forward, then ``torch.autograd.grad`` of its outputs (with
    all-ones output gradients) with respect to its parameters and floating-point inputs. The result
    is the median of the ``iters`` timed runs (the device is synchronised around each). Gradients
    are returned, not accumulated, so the model's ``.grad`` fields are untouched. Units that never
    run get 0. Use a micro-batch shaped like training's; the numbers feed ``balanced_partition``.
    """
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    hooks: list[RemovableHandle] = []
    for unit in units:
        def hook(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any], name: str = unit.name) -> None:
            captured.setdefault(name, _detach((a, kw)))
        hooks.append(model.get_submodule(unit.name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args, **(kwargs or {}))
    finally:
        for handle in hooks:
            handle.remove()

    times = []
    for unit in units:
        if unit.name not in captured:
            times.append(0.0)
            continue
        module = model.get_submodule(unit.name)
        a, kw = captured[unit.name]
        inputs = [t for t in _tensors((a, kw)) if t.requires_grad]
        params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
        samples = []
        for i in range(warmup + iters):
            _sync(inputs + params)
            start = time.perf_counter()
            out = [t for t in _tensors(module(*a, **kw)) if t.requires_grad]
            if out and (inputs or params):
                torch.autograd.grad(out, inputs + params, [torch.ones_like(t) for t in out], allow_unused=True)
            _sync(inputs + params)
            if i >= warmup:
                samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples) if samples else 0.0)
    return times


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().clone()
        return t.requires_grad_(True) if t.is_floating_point() else t
    if isinstance(obj, (tuple, list)):
        return type(obj)(_detach(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    return obj


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _sync(tensors: Iterable[torch.Tensor]) -> None:
    for t in tensors:
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
            return


# ------------------------------------------------------------------------------------ algorithms
def balanced_partition(costs: list[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous non-empty ``[start, end)`` ranges over ``costs`` minimising the largest range sum.

    Exact: the optimal bottleneck is one of the O(n^2) range sums, found by binary search with a
    greedy feasibility check. Among the partitions reaching it, the one with the smallest sum of
    squared stage costs is chosen (then the smallest sum of squared stage sizes), ties going to
    the earliest boundaries, so uniform costs give :func:`even_partition`'s split.
    """
    n = len(costs)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"num_stages={num_stages!r} must be a positive integer")
    if num_stages > n:
        raise PartitionError(f"num_stages={num_stages} is more than the {n} items to split; "
                             f"every stage needs at least one")
    for i, c in enumerate(costs):
        if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 0):
            raise PartitionError(f"costs[{i}]={c!r} must be a finite number >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def rsum(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    def stages_needed(limit: float) -> int:  # greedy: fewest stages with every range sum <= limit
        count, i = 0, 0
        while i < n:
            if rsum(i, i + 1) > limit:
                return n + 1
            j = i + 1
            while j < n and rsum(i, j + 1) <= limit:
                j += 1
            count, i = count + 1, j
        return count

    candidates = sorted({rsum(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1  # the whole sum is always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if stages_needed(candidates[mid]) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    bottleneck = candidates[lo]

    # Exactly num_stages ranges, each <= bottleneck: minimise (sum of squared normalised costs,
    # sum of squared sizes) over suffixes; reconstruct from the left taking the earliest boundary.
    total = prefix[-1] or 1.0
    tol = 1e-12
    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][n] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        for i in range(n - s, -1, -1):
            cur = inf
            for j in range(i + 1, n - s + 2):
                if rsum(i, j) > bottleneck:
                    break
                rest = best[s - 1][j]
                if rest[0] == math.inf:
                    continue
                cand = ((rsum(i, j) / total) ** 2 + rest[0], (j - i) ** 2 + rest[1])
                if _better(cand, cur, tol):
                    cur = cand
            best[s][i] = cur
    ranges, i = [], 0
    for s in range(num_stages, 0, -1):
        target = best[s][i]
        for j in range(i + 1, n - s + 2):
            if rsum(i, j) > bottleneck:
                break
            rest = best[s - 1][j]
            if rest[0] == math.inf:
                continue
            cand = ((rsum(i, j) / total) ** 2 + rest[0], (j - i) ** 2 + rest[1])
            if not _better(target, cand, tol):  # cand is as good as the optimum: take it
                ranges.append((i, j))
                i = j
                break
        else:  # pragma: no cover - the DP guarantees a choice exists
            raise AssertionError("balanced_partition: reconstruction failed")
    assert i == n and len(ranges) == num_stages
    return ranges


def _better(a: tuple[float, float], b: tuple[float, float], tol: float) -> bool:
    if a[0] < b[0] - tol:
        return True
    if a[0] > b[0] + tol:
        return False
    return a[1] < b[1]


def even_partition(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """NxD's even split by layer count: ``num_blocks // num_stages`` blocks per stage, the
    remainder one each on the last stages. Ranges over blocks only (the embedding goes with the
    first stage and the head with the last, whatever their cost)."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"num_stages={num_stages!r} must be a positive integer")
    if num_stages > num_blocks:
        raise PartitionError(f"more stages than blocks: num_stages={num_stages} but the model has "
                             f"{num_blocks} blocks; every stage must hold at least one block")
    base, extra = divmod(num_blocks, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s >= num_stages - extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


# ------------------------------------------------------------------------------------- partition
@dataclass
class Partition:
    """Unit names per global stage (in model order) and each stage's cost."""

    stages: list[list[str]]
    costs: list[float]
    method: str = "balanced"
    cost_kind: str = "cost"
    units: list[Unit] = field(default_factory=list, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of(self, name: str) -> int:
        """Index of the stage holding unit ``name``."""
        for s, names in enumerate(self.stages):
            if name in names:
                return s
        raise PartitionError(f"unit {name!r} is in no stage; units: {', '.join(n for st in self.stages for n in st)}")

    def cuts(self) -> list[str]:
        """The first block of stages 1.., i.e. the ``cuts`` that rebuild this partition with
        ``method="manual"``."""
        blocks = {u.name for u in self.units if u.kind == "block"}
        return [next(n for n in names if n in blocks) for names in self.stages[1:]]

    def stage_layers(self) -> list[list[int]]:
        """Block indices (the trailing integer of each block name) per stage, the layout
        ``plait.materialize.build_stages`` takes."""
        blocks = {u.name for u in self.units if u.kind == "block"}
        out = []
        for names in self.stages:
            ids = []
            for n in names:
                if n in blocks:
                    m = re.search(r"(\d+)$", n)
                    if m is None:
                        raise PartitionError(f"block name {n!r} does not end with a layer index")
                    ids.append(int(m.group(1)))
            out.append(ids)
        return out

    def describe(self) -> str:
        """A table (stage, units, cost, share of the total) and the bottleneck, for logs."""
        total = sum(self.costs)
        rows = [("stage", "units", self.cost_kind, "share")]
        for s, (names, cost) in enumerate(zip(self.stages, self.costs, strict=True)):
            share = f"{100 * cost / total:.1f}%" if total > 0 else "-"
            rows.append((str(s), compress_names(names), _fmt_cost(cost, self.cost_kind), share))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        lines = [f"{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}".rstrip()
                 for r in rows]
        if total > 0 and self.costs:
            worst = max(range(len(self.costs)), key=lambda s: self.costs[s])
            lines.append(f"bottleneck: stage {worst} with {100 * self.costs[worst] / total:.1f}% of the total "
                         f"(ideal {100 / len(self.costs):.1f}% for {len(self.costs)} stages); method={self.method}")
        else:
            lines.append(f"method={self.method}")
        return "\n".join(lines)


def compress_names(names: list[str]) -> str:
    """``model.embed_tokens, layers 0-3`` for ``[model.embed_tokens, model.layers.0, ..., model.layers.3]``:
    runs of consecutive ``<prefix>.<i>`` names become ``<last prefix part> i-j``."""
    parts: list[str] = []
    run: tuple[str, int, int] | None = None

    def flush() -> None:
        if run is not None:
            label = run[0].rsplit(".", 1)[-1]
            parts.append(f"{label} {run[1]}" if run[1] == run[2] else f"{label} {run[1]}-{run[2]}")

    for name in names:
        m = re.fullmatch(r"(.+)\.(\d+)", name)
        if m and run is not None and run[0] == m.group(1) and run[2] + 1 == int(m.group(2)):
            run = (run[0], run[1], int(m.group(2)))
            continue
        flush()
        run = None
        if m:
            run = (m.group(1), int(m.group(2)), int(m.group(2)))
        else:
            parts.append(name)
    flush()
    return ", ".join(parts)


def _fmt_cost(x: float, kind: str) -> str:
    if kind == "seconds":
        return f"{x * 1e3:.3g} ms"
    if abs(x) < 1000:
        return f"{x:g}" if x == int(x) else f"{x:.3g}"
    for suffix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"  # pragma: no cover


def partition_model(units: list[Unit], costs: list[float] | None, num_stages: int, method: str = "balanced",
                    cuts: list[str] | None = None, *, cost_kind: str | None = None) -> Partition:
    """Assign every unit to one of ``num_stages`` contiguous stages.

    Units before the first block (embedding, rotary tables) are pinned to stage 0, units after the
    last block (final norm, head) to the last stage; every stage holds at least one block.
    ``method``: ``"balanced"`` minimises the largest stage cost (:func:`balanced_partition`, the
    pinned units' costs counted on their stages), ``"even"`` splits the blocks by count
    (:func:`even_partition`), ``"manual"`` starts a new stage at each name in ``cuts``
    (``num_stages - 1`` block names in model order, e.g. ``["model.layers.4", "model.layers.8"]``).
    ``costs``: one per unit (``None``: one per block, zero elsewhere, i.e. layer count);
    ``cost_kind`` labels them in :meth:`Partition.describe` (``"params"``, ``"flops"``,
    ``"seconds"``...; default ``"cost"``, or ``"blocks"`` when ``costs`` is ``None``).
    Raises :class:`PartitionError` for an unknown method, bad cuts, or more stages than blocks.
    """
    if method not in PARTITION_METHODS:
        raise PartitionError(f"method={method!r} is not valid; valid: {', '.join(map(repr, PARTITION_METHODS))}")
    if cuts is not None and method != "manual":
        raise PartitionError(f"cuts={cuts!r} are only used with method='manual' (got method={method!r})")
    if costs is None:
        costs = [1.0 if u.kind == "block" else 0.0 for u in units]
        cost_kind = cost_kind or "blocks"
    if len(costs) != len(units):
        raise PartitionError(f"got {len(costs)} costs for {len(units)} units; give one cost per unit")
    cost_kind = cost_kind or "cost"
    block_idx = [i for i, u in enumerate(units) if u.kind == "block"]
    if not block_idx:
        raise PartitionError("the units hold no block (kind='block'); nothing to split into stages")
    first, last = block_idx[0], block_idx[-1]
    inside = [u.name for u in units[first:last + 1] if u.kind != "block"]
    if inside:
        raise PartitionError(f"unit(s) {', '.join(inside)} lie between the blocks; stages are cut only between "
                             f"consecutive blocks")
    misplaced = ([u.name for u in units[last + 1:] if u.kind == "embedding"]
                 + [u.name for u in units[:first] if u.kind in ("norm", "head")])
    if misplaced:
        raise PartitionError(f"unit(s) {', '.join(misplaced)} cannot be pinned: the embedding must come before "
                             f"the blocks (first stage) and the norm/head after them (last stage)")
    num_blocks = len(block_idx)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PartitionError(f"num_stages={num_stages!r} must be a positive integer")
    if num_stages > num_blocks:
        raise PartitionError(f"more stages than blocks: num_stages={num_stages} but the model has {num_blocks} "
                             f"blocks; every stage must hold at least one block")

    if method == "even":
        ranges = even_partition(num_blocks, num_stages)
    elif method == "balanced":
        block_costs = [float(costs[i]) for i in block_idx]
        block_costs[0] += sum(float(c) for c in costs[:first])
        block_costs[-1] += sum(float(c) for c in costs[last + 1:])
        ranges = balanced_partition(block_costs, num_stages)
    else:
        ranges = _manual_ranges([units[i].name for i in block_idx], units, num_stages, cuts)

    stages = []
    for s, (a, b) in enumerate(ranges):
        lo = 0 if s == 0 else first + a
        hi = len(units) if s == num_stages - 1 else first + b
        stages.append(list(range(lo, hi)))
    assert sorted(i for st in stages for i in st) == list(range(len(units)))
    return Partition(stages=[[units[i].name for i in st] for st in stages],
                     costs=[float(sum(costs[i] for i in st)) for st in stages],
                     method=method, cost_kind=cost_kind, units=list(units))


def _manual_ranges(block_names: list[str], units: list[Unit], num_stages: int,
                   cuts: list[str] | None) -> list[tuple[int, int]]:
    valid = block_names[1:]
    valid_text = ", ".join(valid) if valid else "none (the model has one block)"
    if cuts is None:
        raise PartitionError(f"method='manual' needs cuts: the {num_stages - 1} block names at which stages "
                             f"1..{num_stages - 1} start; valid cut names: {valid_text}")
    cuts = list(cuts)
    if len(cuts) != num_stages - 1:
        raise PartitionError(f"num_stages={num_stages} needs {num_stages - 1} cuts (the block at which each stage "
                             f"after the first starts), got {len(cuts)}: {cuts}")
    all_names = {u.name for u in units}
    positions = []
    for cut in cuts:
        if cut not in all_names:
            raise PartitionError(f"cut {cut!r} is not a module of the model; valid cut names: {valid_text}")
        if cut not in block_names:
            raise PartitionError(f"cut {cut!r} is not a block: stages start at blocks (the embedding is pinned to "
                                 f"the first stage, the norm and head to the last); valid cut names: {valid_text}")
        if cut == block_names[0]:
            raise PartitionError(f"cut {cut!r} is the first block, which always starts stage 0 (a stage before it "
                                 f"would hold no block); valid cut names: {valid_text}")
        positions.append(block_names.index(cut))
    if any(b <= a for a, b in itertools.pairwise(positions)):
        raise PartitionError(f"cuts {cuts} must be in model order without repeats")
    bounds = [0] + positions + [len(block_names)]
    return [(bounds[s], bounds[s + 1]) for s in range(num_stages)]
